-- Enqueue (docs/dedupe.md, "Order of checks"): every item of a batch is
-- decided against the stored state with the effects of the earlier items
-- laid over it (O), and only then, unless the call is a dry run or an
-- all-or-nothing batch with a failing item, are the writes applied.

local function idem_name(scope, hash)
  return scope .. '|' .. hash
end

-- A live idempotency binding, as this call sees it.
local function idem_get(scope, hash)
  local name = idem_name(scope, hash)
  local b = O.idem[name]
  if b == nil then
    local r = redis.call('HMGET', P .. 'idem:' .. name, 'job', 'fp', 'expires')
    if r[1] then
      b = { job = r[1], fp = r[2], expires = idem_until(r[1], r[3]) }
    else
      b = false
    end
    O.idem[name] = b
  end
  if b and b.expires > NOW then
    return b
  end
  return nil
end

-- A job as enqueue decisions see it.
local function ejob(id)
  local j = O.jobs[id]
  if j == nil then
    local r = redis.call('HMGET', jkey(id), 'state', 'attempt', 'run_at', 'fingerprint')
    if r[1] then
      local row = 'job ' .. id
      j = {
        state = r[1], attempt = stored_int(r[2], row, 'job.attempt'),
        run_at = stored_int(r[3], row, 'job.run_at'), fp = r[4],
      }
    else
      j = false
    end
    O.jobs[id] = j
  end
  return j or nil
end

local function ekeyed(id)
  local j = ejob(id)
  if not j then
    return keyed_of(nil)
  end
  return keyed_of(j.state, j.attempt, j.run_at)
end

local function dd_get(jtype, key)
  local name = ddname(jtype, key)
  local b = O.dd[name]
  if b == nil then
    b = read_dd(jtype, key) or false
    O.dd[name] = b
  end
  return b or nil
end

local function later(f)
  O.writes[#O.writes + 1] = f
end

-- Binds an idempotency key to a job (any binding there is expired: a live
-- one would have decided the request).
local function bind_key(scope, hash, preview, ttl_ms, job_id, fp)
  local name = idem_name(scope, hash)
  local expires = NOW + ttl_ms * 1000
  O.idem[name] = { job = job_id, fp = fp, expires = expires }
  later(function()
    write_binding(name, job_id, fp, preview, expires)
  end)
end

-- Whether two packed fingerprints match for a request naming an existing
-- job: the key retention (field 4) and the job id (field 5) are not compared.
local function fp_eq_job(a, b)
  if not a or not b or #a ~= #b then
    return false
  end
  return a:sub(1, 96) == b:sub(1, 96) and a:sub(161) == b:sub(161)
end

-- The dedupe decision (crate::dedupe::Binding::decide): 'replace',
-- 'coalesce', 'rearm' (coalesce and re-arm) or 'non_replaceable:<reason>'.
local function decide(b, kj, mode)
  if b.mode == 'replace' and mode == 'replace' then
    if kj.kind == 'waiting' and not kj.started then
      if kj.due then
        return 'non_replaceable:window_elapsed'
      end
      return 'replace'
    end
    return 'non_replaceable:not_pending'
  elseif b.mode == 'replace' then
    return 'coalesce'
  elseif mode == 'replace' then
    return 'non_replaceable:incompatible_mode'
  elseif b.mode == 'debounce' then
    return 'rearm'
  end
  return 'coalesce'
end

local function debounce_window(ttl, mw, acc)
  local until_ = NOW + ttl * 1000
  if mw then
    return math.min(until_, acc + mw * 1000)
  end
  return until_
end

local function resolve_run_at(p, first, mw)
  local run_at = p.run_at or (NOW + (p.delay or 0) * 1000)
  if mw then
    return math.min(run_at, first + mw * 1000)
  end
  return run_at
end

-- The checks against the clock, only when a job is created or replaced.
local function check_clock(p, run_at)
  if p.deadline then
    if p.deadline <= NOW then
      return { 'invalid', 'deadline' }
    end
    if run_at >= p.deadline then
      if p.delay then
        return { 'invalid', 'delay_ms' }
      end
      return { 'invalid', 'run_at' }
    end
  end
  return nil
end

local function set_window(jtype, key, until_)
  local b = dd_get(jtype, key)
  b.wu = until_
  local name = ddname(jtype, key)
  later(function()
    redis.call('HSET', P .. 'dd:' .. name, 'wu', I(until_))
    redis.call('ZADD', P .. 'ddexp', I(until_), name)
  end)
end

-- The fields a request sets on a job it creates or replaces.
local function job_fields(p, run_at)
  return {
    payload = p.payload, priority = p.priority, run_at = I(run_at),
    max_attempts = p.max_attempts, retry = p.retry, timeout_ms = p.timeout_ms,
    deadline = p.deadline and I(p.deadline) or false,
    concurrency_key = p.ck or false, tags = p.tags,
    keep_ms = p.keep and I(p.keep) or false, fingerprint = p.fp, updated_at = I(NOW),
  }
end

-- Writes a new job: its hash in one HSET (no field for a NULL), its
-- queue's listing index and the indexes of the waiting state (what enter()
-- does, written out: this is the path every job takes).
local function write_job(p, id, run_at)
  local seq = nextseq()
  local s, now, at = I(seq), I(NOW), I(run_at)
  local h = {
    'id', id, 'type', p.type, 'queue', p.queue, 'state', 'waiting', 'payload', p.payload,
    'priority', p.priority, 'run_at', at, 'attempt', '0', 'attempts_used', '0',
    'max_attempts', p.max_attempts, 'retry', p.retry, 'timeout_ms', p.timeout_ms,
    'tags', p.tags, 'fingerprint', p.fp, 'created_at', now, 'updated_at', now, 'seq', s,
  }
  local n = #h
  local function add(k, v)
    h[n + 1] = k
    h[n + 2] = v
    n = n + 2
  end
  if run_at ~= NOW then
    add('first_run_at', at)
  end
  if p.deadline then
    add('deadline', I(p.deadline))
  end
  if p.ck then
    add('concurrency_key', p.ck)
  end
  if p.keep then
    add('keep_ms', I(p.keep))
  end
  if p.scope then
    add('idem_scope', p.scope)
    add('idem_key_hash', p.hash)
    add('idem_key_preview', p.preview)
  end
  if p.dkey then
    add('dedupe_key', p.dkey)
    add('dedupe_mode', p.dmode)
    redis.call('SADD', P .. 'dk:' .. ddname(p.type, p.dkey), id)
  end
  redis.call('HSET', jkey(id), unpack(h))
  ROWS[id] = nil
  local q = p.queue
  redis.call('ZADD', P .. 'qj:' .. q, s, id)
  local lane = p.priority .. '|' .. p.type
  redis.call('ZADD', P .. 'w:' .. q .. '|' .. lane, at, string.format('%016d', seq) .. id)
  -- A queue that is not in `queues` has no job, so the first job of any
  -- of its lanes is the only one that can be its first.
  if redis.call('HINCRBY', P .. 'wl:' .. q, lane, 1) == 1 then
    redis.call('SADD', P .. 'queues', q)
  end
  redis.call('ZADD', P .. 'st:waiting', s, id)
  wake(q)
end

local function insert_job(p, id, run_at)
  O.jobs[id] = { state = 'waiting', attempt = 0, run_at = run_at, fp = p.fp }
  later(function()
    write_job(p, id, run_at)
  end)
end

local function replace_job(p, id, run_at)
  -- The stored row is written over: it must read (one this batch creates
  -- is not stored yet, and is read when its write has run).
  local stored = load(id)
  if stored then
    checked(stored)
  end
  local ej = O.jobs[id]
  ej.run_at = run_at
  ej.fp = p.fp
  later(function()
    local j = load(id)
    move(j, job_fields(p, run_at))
    event(id, 'replaced', obj('run_at', I(run_at)))
    wake(j.queue)
  end)
end

local function bind_dedupe(p, id, run_at)
  local name = ddname(p.type, p.dkey)
  local wu = nil
  if p.dttl then
    if p.dmode == 'debounce' then
      wu = debounce_window(p.dttl, p.dmw, NOW)
    elseif p.dmode == 'replace' then
      -- A replace window cannot end before its job is due.
      wu = math.max(NOW + p.dttl * 1000, run_at)
    else
      wu = NOW + p.dttl * 1000
    end
  end
  O.dd[name] = { job = id, mode = p.dmode, ttl = p.dttl, mw = p.dmw, acc = NOW, wu = wu }
  later(function()
    local k = P .. 'dd:' .. name
    redis.call('DEL', k)
    redis.call('HSET', k, 'job', id, 'mode', p.dmode, 'acc', I(NOW))
    if p.dttl then
      redis.call('HSET', k, 'ttl', I(p.dttl))
    end
    if p.dmw then
      redis.call('HSET', k, 'mw', I(p.dmw))
    end
    if wu then
      redis.call('HSET', k, 'wu', I(wu))
      redis.call('ZADD', P .. 'ddexp', I(wu), name)
    else
      redis.call('ZREM', P .. 'ddexp', name)
    end
  end)
end

local function bind_request_key(p, id)
  if p.scope then
    bind_key(p.scope, p.hash, p.preview, p.ttl, id, p.fp)
  end
end

-- Decides one request: {'ok', id, outcome}, {'conflict', id, source,
-- stored fingerprint} or {'invalid', field}.
local function enqueue_one(p)
  -- 1. A live idempotency binding decides: replay or conflict.
  if p.scope then
    local b = idem_get(p.scope, p.hash)
    if b then
      if b.fp == p.fp then
        return { 'ok', b.job, 'replayed' }
      end
      return { 'conflict', b.job, 'idempotency_key', b.fp }
    end
  end
  -- 2. An existing record with the explicit id: replay or conflict.
  if p.job_id then
    local j = ejob(p.job_id)
    if j then
      if not fp_eq_job(p.fp, j.fp) then
        return { 'conflict', p.job_id, 'job_id', j.fp or '' }
      end
      bind_request_key(p, p.job_id)
      return { 'ok', p.job_id, 'replayed' }
    end
  end
  -- 3. A live dedupe binding: coalesce, replace or refuse to replace.
  local first = NOW
  if p.dkey then
    local b = dd_get(p.type, p.dkey)
    if b then
      local kj = ekeyed(b.job)
      if is_live(b, kj) then
        local d = decide(b, kj, p.dmode)
        local outcome = d
        if d == 'rearm' or d == 'coalesce' then
          if d == 'rearm' and b.ttl then
            set_window(p.type, p.dkey, debounce_window(b.ttl, b.mw, b.acc))
          end
          outcome = 'coalesced'
        elseif d == 'replace' then
          first = b.acc
          local run_at = resolve_run_at(p, first, b.mw)
          local bad = check_clock(p, run_at)
          if bad then
            return bad
          end
          replace_job(p, b.job, run_at)
          if b.ttl then
            set_window(p.type, p.dkey, math.max(NOW + b.ttl * 1000, run_at))
          end
          outcome = 'replaced'
        end
        bind_request_key(p, b.job)
        return { 'ok', b.job, outcome }
      end
    end
  end
  -- 4. A new job.
  local run_at = resolve_run_at(p, first, p.dmw)
  local bad = check_clock(p, run_at)
  if bad then
    return bad
  end
  local id = p.job_id or p.new_id
  insert_job(p, id, run_at)
  bind_request_key(p, id)
  if p.dkey then
    bind_dedupe(p, id, run_at)
  end
  return { 'ok', id, 'accepted' }
end

-- Arguments per item, in order (see enqueue.rs).
local ITEM = 23

local function opt(s)
  if s == '' then
    return nil
  end
  return s
end

local function item(args, at)
  return {
    type = args[at], queue = args[at + 1], job_id = opt(args[at + 2]), payload = args[at + 3],
    priority = args[at + 4], run_at = A(args[at + 5]), delay = A(args[at + 6]),
    max_attempts = args[at + 7], retry = args[at + 8], timeout_ms = args[at + 9],
    deadline = A(args[at + 10]), ck = opt(args[at + 11]), tags = args[at + 12],
    keep = A(args[at + 13]), fp = args[at + 14], scope = opt(args[at + 15]), hash = args[at + 16],
    preview = args[at + 17], ttl = A(args[at + 18]), dkey = opt(args[at + 19]),
    dmode = args[at + 20], dttl = A(args[at + 21]), dmw = A(args[at + 22]), new_id = args[at + 23],
  }
end

-- args: prefix, clock, atomic, dry run, then ITEM + 1 arguments per item.
reg('enqueue', function(args)
  local atomic, dry = args[3] == '1', args[4] == '1'
  local out = {}
  local failed = false
  local at = 5
  while at + ITEM <= #args do
    local r = enqueue_one(item(args, at))
    if r[1] ~= 'ok' then
      failed = true
    end
    out[#out + 1] = r
    at = at + ITEM + 1
  end
  if not dry and not (atomic and failed) then
    for _, w in ipairs(O.writes) do
      w()
    end
  end
  return out
end)

-- The enqueue path of one request, writing nothing, and who holds its keys:
-- {result, {idempotency job, expires} or {}, {dedupe job, mode, window} or {}}.
reg('explain', function(args)
  local p = item(args, 3)
  local idem = {}
  if p.scope then
    local b = idem_get(p.scope, p.hash)
    if b then
      idem = { b.job, I(b.expires) }
    end
  end
  local dd = {}
  if p.dkey then
    local b = dd_get(p.type, p.dkey)
    if b and is_live(b, ekeyed(b.job)) then
      dd = { b.job, b.mode, b.wu and I(b.wu) or '' }
    end
  end
  return { enqueue_one(p), idem, dd }
end, true)
