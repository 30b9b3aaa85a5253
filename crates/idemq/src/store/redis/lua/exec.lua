-- Execution: claim, heartbeat, complete, fail, release, checkpoints and the
-- reaping of expired leases. Every call after the claim is fenced by the
-- lease token: a stale token changes nothing and is told 'lease_lost'.

local function load_active(id, token)
  local j = load(id)
  if j and j.state == 'active' and j.lease_token == token then
    return j
  end
  return nil
end

-- The backoff in ms after `used` consumed attempts, or nil for none
-- (crate::retry::next_delay_ms; `unit` is a uniform draw from [0, 1)).
local function next_delay(retry, used, unit)
  local r = cjson.decode(retry)
  if r.kind == 'none' then
    return nil
  elseif r.kind == 'fixed' then
    return r.delay_ms
  end
  local exp = math.min(math.max(used, 1) - 1, 1024)
  local raw = r.initial_ms * (r.factor ^ exp)
  local capped = r.max_ms
  if raw == raw and raw ~= math.huge and raw ~= -math.huge then
    capped = math.min(raw, r.max_ms)
  end
  if r.jitter then
    capped = capped * math.min(math.max(unit, 0), 1)
  end
  return math.floor(capped + 0.5)
end

-- What follows an attempt's end (docs/state-machine.md): {kind, at, event}.
local function decide_next(j, e, used)
  local deadline = N(j.deadline)
  local function past(at)
    return deadline ~= nil and at >= deadline
  end
  local function retry_at(ms)
    local at = NOW + ms * 1000
    if past(at) then
      return { 'dead', 'deadline' }
    end
    return { 'waiting', at, 'retry_scheduled' }
  end
  if e.kind == 'completed' then
    return { 'completed' }
  elseif j.cancel_requested == '1' then
    return { 'cancelled' }
  elseif e.kind == 'released' then
    return { 'waiting', NOW, 'released' }
  elseif e.kind == 'snoozed' then
    return retry_at(e.snooze)
  elseif e.kind == 'deadline' then
    return { 'dead', 'deadline' }
  elseif e.kind == 'failed' and not e.retryable then
    return { 'dead', 'permanent' }
  elseif used >= tonumber(j.max_attempts) then
    return { 'dead', 'attempts_exhausted' }
  elseif e.kind == 'lease_expired' then
    -- An expired lease is claimable again at once (its attempt is consumed).
    if past(NOW) then
      return { 'dead', 'deadline' }
    end
    return { 'waiting', NOW, nil }
  end
  local delay = next_delay(j.retry, used, e.unit)
  if delay == nil then
    return { 'dead', 'no_retry' }
  end
  if e.kind == 'failed' and e.retry_after then
    delay = e.retry_after
  end
  return retry_at(math.max(delay, 0))
end

-- Ends the attempt of active job j; returns {state, next run_at or ''}.
local function end_attempt(j, e)
  local consumed = not (e.kind == 'released' or e.kind == 'snoozed')
  local used = tonumber(j.attempts_used)
  if consumed then
    used = used + 1
  end
  local outcome, err = e.kind, nil
  if e.kind == 'failed' then
    err = e.error
  elseif e.kind == 'lease_expired' then
    err = 'lease expired'
  elseif e.kind == 'timed_out' then
    outcome = 'failed'
    err = 'timed out after ' .. j.timeout_ms .. ' ms'
  elseif e.kind == 'deadline' then
    outcome = 'failed'
    err = 'deadline passed'
  end
  if j.cancel_requested == '1' and e.kind ~= 'completed' then
    outcome = 'cancelled'
  end
  local next = decide_next(j, e, used)
  -- Writes only from here on.
  -- A completed attempt stays derived from the job hash; one that ends
  -- otherwise is written out now, its `claimed` event under the number the
  -- claim drew.
  if e.kind ~= 'completed' then
    local worker = j.worker or ''
    local run = obj('attempt', j.attempt, 'worker', js(worker), 'started_at', j.started_at,
      'finished_at', I(NOW), 'outcome', js(outcome), 'error', err and js(err) or 'null')
    redis.call('RPUSH', P .. 'runs:' .. j.id, run)
    local seq = N(j.claim_seq) or nextseq()
    event_at(seq, j.id, 'claimed', j.started_at, obj('attempt', j.attempt, 'worker', js(worker)))
  end
  if e.kind == 'lease_expired' then
    event(j.id, 'lease_expired', obj('attempt', j.attempt))
  end
  local kind = next[1]
  if kind == 'completed' then
    -- The worker, start and claim number stay: the run and the `claimed`
    -- and `completed` events are derived from them.
    move(j, {
      state = 'completed', result = e.result or false, finished_at = NOW,
      purge_after = NOW + keep_us(j, 'completed'), lease_token = false, lease_expires_at = false,
      lease_ms = false, updated_at = NOW, attempts_used = used, done_seq = nextseq(),
    })
    return { 'completed', '' }
  elseif kind == 'waiting' then
    local at = next[2]
    local ch = {
      state = 'waiting', run_at = at, lease_token = false, lease_expires_at = false,
      lease_ms = false, worker = false, started_at = false, claim_seq = false,
      updated_at = NOW, attempts_used = used,
    }
    if err then
      ch.last_error = err
    end
    move(j, ch)
    if next[3] then
      local snoozed = 'false'
      if e.kind == 'snoozed' then
        snoozed = 'true'
      end
      event(j.id, next[3], obj('run_at', I(at), 'snoozed', snoozed))
    end
    wake(j.queue)
    if at <= NOW then
      return { 'ready', I(at) }
    end
    return { 'scheduled', I(at) }
  elseif kind == 'dead' then
    finish(j, 'dead', used, err or next[2])
    event(j.id, 'dead', obj('reason', js(next[2]), 'attempt', j.attempt))
    return { 'dead', '' }
  end
  finish(j, 'cancelled', used, err)
  release_dedupe(j)
  event(j.id, 'cancelled', obj('attempt', j.attempt))
  return { 'cancelled', '' }
end

-- A claim, a batch of completions and the reaping of expired leases act
-- on many jobs, each decision depending on the ones before it (a
-- completion frees a key whose parked job the claim then takes; a reaped
-- job is claimable at once). Each is decided in full over a view (v) of
-- the stored state with the call's earlier decisions laid over it, every
-- row it will write checked on the way, and only then applied in order:
-- a row that does not read ends the call with nothing written.
--   v.rows[id]  the job as the decisions so far leave it (a copy once
--               changed; the stored row, from ROWS, until then)
--   v.ck[key]   the job holding a concurrency key (false: free)
--   v.freed     the keys the decisions so far free, to settle
--   v.gone      jobs the decisions take out of `leases`, and how many
--   v.extra     entries the decisions add to lanes, by lane key
local function view()
  return { rows = {}, ck = {}, freed = {}, gone = {}, ngone = 0, extra = {} }
end

local function vrow(v, id)
  local j = v.rows[id]
  if j == nil then
    j = load(id) or false
    v.rows[id] = j
  end
  return j or nil
end

-- Lays the changes `ch` (false deletes a field) over job j in the view.
local function vset(v, j, ch)
  local c = {}
  for k, x in pairs(j) do
    c[k] = x
  end
  for k, x in pairs(ch) do
    if x == false then
      c[k] = nil
    elseif type(x) == 'number' then
      c[k] = I(x)
    else
      c[k] = x
    end
  end
  v.rows[j.id] = c
  return c
end

local function vholder(v, key)
  local h = v.ck[key]
  if h == nil then
    h = redis.call('GET', P .. 'ck:' .. key) or false
    v.ck[key] = h
  end
  return h or nil
end

-- Active job j leaves the active state in the view (leave() in common.lua).
local function vleave_active(v, j)
  v.gone[j.id] = true
  v.ngone = v.ngone + 1
  local key = j.concurrency_key
  if key and vholder(v, key) == j.id then
    v.ck[key] = false
    v.freed[key] = true
  end
end

local function vextra(v, lane, member, score, j)
  local l = v.extra[lane]
  if not l then
    l = {}
    v.extra[lane] = l
  end
  l[#l + 1] = { member = member, score = score, queue = j.queue, prio = tonumber(j.priority), type = j.type }
end

-- The completions of args from `at`, (id, token, has result, result) × n:
-- per item {id, result}, or false for a lost lease.
local function plan_completions(v, args, at, n)
  local plan = {}
  for k = 0, n - 1 do
    local i = at + k * 4
    local j = vrow(v, args[i])
    if j and j.state == 'active' and j.lease_token == args[i + 1] then
      checked(j)
      local result = nil
      if args[i + 2] == '1' then
        result = args[i + 3]
      end
      plan[#plan + 1] = { id = j.id, result = result }
      vleave_active(v, j)
      vset(v, j, { state = 'completed' })
    else
      plan[#plan + 1] = false
    end
  end
  return plan
end

local function apply_completions(plan)
  local out = {}
  for _, d in ipairs(plan) do
    if d then
      end_attempt(load(d.id), { kind = 'completed', result = d.result })
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return out
end

-- The expired leases to record (at most `limit`, counted as if the
-- decisions before had been written): per entry {id, reap} (reap false
-- drops an entry its job left behind).
local function plan_reap(v, limit)
  local plan = {}
  local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', I(NOW), 'LIMIT', 0, limit + v.ngone)
  local seen = 0
  for _, id in ipairs(ids) do
    if seen >= limit then
      break
    end
    if not v.gone[id] then
      seen = seen + 1
      local j = vrow(v, id)
      if j and j.state == 'active' then
        checked(j)
        if jint(j, 'lease_expires_at') <= NOW then
          plan[#plan + 1] = { id = id, reap = true }
          local used = jint(j, 'attempts_used') + 1
          local next = decide_next(j, { kind = 'lease_expired' }, used)
          vleave_active(v, j)
          if next[1] == 'waiting' then
            -- Back in its lane, due at once: this call's claim may take it.
            vextra(v, wkey(j), wmember(j), next[2], j)
            vset(v, j, {
              state = 'waiting', run_at = next[2], attempts_used = used, lease_token = false,
              lease_expires_at = false, lease_ms = false, worker = false, started_at = false,
              claim_seq = false, parked = false,
            })
          else
            vset(v, j, { state = next[1] })
          end
        end
      else
        plan[#plan + 1] = { id = id, reap = false }
      end
    end
  end
  return plan
end

-- What a call records beside what it was asked, for the caller's
-- counters: {expired leases, jobs sent back to run, jobs sent to the dead
-- letters}.
local function recorded()
  return { 0, 0, 0 }
end

-- An attempt or job the call ended, leaving it in `state`.
local function ended(r, state)
  if state == 'ready' or state == 'scheduled' then
    r[2] = r[2] + 1
  elseif state == 'dead' then
    r[3] = r[3] + 1
  end
end

-- Applies the reap's plan, counting in r.
local function apply_reap(plan, r)
  for _, d in ipairs(plan) do
    if d.reap then
      local e = end_attempt(load(d.id), { kind = 'lease_expired' })
      r[1] = r[1] + 1
      ended(r, e[1])
    else
      redis.call('ZREM', P .. 'leases', d.id)
    end
  end
end

-- What settle() will put back in lanes for the keys the decisions freed
-- (unpark in common.lua, read only).
local function plan_settle(v)
  for key in pairs(v.freed) do
    if not vholder(v, key) then
      for _, lf in ipairs(redis.call('HKEYS', P .. 'ckwl:' .. key)) do
        local top = redis.call('ZRANGE', ckw(key, lf), 0, 99, 'WITHSCORES')
        for i = 1, #top, 2 do
          local member = top[i]
          local j = vrow(v, member:sub(17))
          if parked_here(j, key, lf, member) then
            vextra(v, P .. 'w:' .. lf, member, tonumber(top[i + 1]), j)
            vset(v, j, { parked = false })
            break
          end
        end
      end
    end
  end
  v.freed = {}
end

-- Candidates a claim parks without taking them, at most: a bound on one
-- call's work. Parked entries leave their lanes, so each is parked once
-- and the next claim goes on past them; a backlog of one held key costs
-- claims nothing after that.
local SKIP_LIMIT = 10000
-- Jobs past their deadline a claim ends, at most (as on PostgreSQL and
-- SQLite: 8 pages of 256): Redis runs nothing else while a call runs, and
-- the claims after this one end the rest.
local DEADLINE_LIMIT = 2048
local PAGE = 64

local function claim_one(j, c)
  local seq = nextseq()
  local token = c.nonce .. I(seq)
  local expires = NOW + c.lease_ms * 1000
  move(j, {
    state = 'active', attempt = tonumber(j.attempt) + 1, lease_token = token,
    lease_expires_at = expires, lease_ms = c.lease_ms, worker = c.worker, started_at = NOW,
    updated_at = NOW, claim_seq = seq,
  })
  return {
    j.id, j.type, j.queue, j.payload, j.attempt, j.max_attempts, token, I(expires),
    j.timeout_ms, j.deadline or '', j.tags,
  }
end

-- Whether lane entry (m, s) comes before (bm, bs): earlier run_at, then
-- acceptance (the member's first 16 characters, its sequence number).
local function before(s, m, bs, bm)
  return s < bs or (s == bs and m:sub(1, 16) < bm:sub(1, 16))
end

-- The claim of up to c.limit due jobs: highest priority first, then
-- oldest run_at, then acceptance, across the waiting lists of the queues
-- and types asked for (one list per queue, priority and type) with the
-- entries the decisions before add to them. Per entry met, in order:
-- {kind = 'claim' | 'park' | 'dead' | 'drop', id, lane, member}.
local function plan_claim(v, c)
  local plan = { n = 0, wake = nil }
  local queues = c.queues
  if #queues == 0 then
    queues = redis.call('SMEMBERS', P .. 'queues')
  end
  local lists, bykey = {}, {}
  local function list(key, prio)
    local l = bykey[key]
    if not l then
      l = { key = key, prio = prio, buf = {}, pos = 1, off = 0, done = false, extra = {}, x = 1 }
      bykey[key] = l
      lists[#lists + 1] = l
    end
    return l
  end
  local open = {}
  for _, q in ipairs(queues) do
    if redis.call('HGET', P .. 'paused', q) ~= '1' then
      open[q] = true
      local fields = redis.call('HKEYS', P .. 'wl:' .. q)
      for _, f in ipairs(fields) do
        local bar = string.find(f, '|', 2, true)
        local prio, jtype = tonumber(f:sub(1, bar - 1)), f:sub(bar + 1)
        if not c.types or c.types[jtype] then
          list(P .. 'w:' .. q .. '|' .. f, prio)
        end
      end
    end
  end
  for key, entries in pairs(v.extra) do
    for _, e in ipairs(entries) do
      if open[e.queue] and e.score <= NOW and (not c.types or c.types[e.type]) then
        local l = list(key, e.prio)
        l.extra[#l.extra + 1] = e
      end
    end
  end
  for _, l in ipairs(lists) do
    table.sort(l.extra, function(a, b)
      return before(a.score, a.member, b.score, b.member)
    end)
  end
  -- The next entry of a lane, and whether it is one the decisions added.
  -- Nothing is written while deciding, so the stored lane is read on from
  -- where the last page ended.
  local function head(l)
    if l.pos > #l.buf and not l.done then
      l.buf = redis.call('ZRANGEBYSCORE', l.key, '-inf', I(NOW), 'WITHSCORES', 'LIMIT', l.off, PAGE)
      l.pos = 1
      l.off = l.off + #l.buf / 2
      if #l.buf < PAGE * 2 then
        l.done = true
      end
    end
    local m, s = nil, nil
    if l.pos <= #l.buf then
      m, s = l.buf[l.pos], tonumber(l.buf[l.pos + 1])
    end
    local e = l.extra[l.x]
    if e and (m == nil or before(e.score, e.member, s, m)) then
      return e.member, e.score, true
    end
    return m, s, false
  end
  local taken = {}
  local skipped, ended = 0, 0
  local function add(kind, j, lane, member)
    plan[#plan + 1] = { kind = kind, id = j.id, lane = lane, member = member }
  end
  while plan.n < c.limit and skipped < SKIP_LIMIT and ended < DEADLINE_LIMIT do
    local best, bm, bs, bx = nil, nil, nil, false
    for _, l in ipairs(lists) do
      local m, s, x = head(l)
      if m then
        local better = best == nil or l.prio > best.prio
          or (l.prio == best.prio and before(s, m, bs, bm))
        if better then
          best, bm, bs, bx = l, m, s, x
        end
      end
    end
    if not best then
      break
    end
    if bx then
      best.x = best.x + 1
    else
      best.pos = best.pos + 2
    end
    local j = vrow(v, bm:sub(17))
    if not j or j.state ~= 'waiting' then
      -- An entry its job left behind: drop it.
      plan[#plan + 1] = { kind = 'drop', lane = best.key, member = bm }
    else
      checked(j)
      local key = j.concurrency_key
      local deadline = N(j.deadline)
      if key and not taken[key] and vholder(v, key) then
        -- Its key is held by a job that was active before this claim: not
        -- a candidate at all (as on SQL), so a passed deadline is left for
        -- the claim that finds the key free. Parked until then.
        add('park', j, best.key, bm)
        vset(v, j, { parked = '1' })
        skipped = skipped + 1
      elseif deadline and deadline <= NOW then
        -- Past its deadline: never started.
        add('dead', j)
        vset(v, j, { state = 'dead' })
        ended = ended + 1
        plan.wake = j.queue
      elseif key and taken[key] then
        -- Its key was taken by this claim: parked until that job ends.
        add('park', j, best.key, bm)
        vset(v, j, { parked = '1' })
        skipped = skipped + 1
      else
        checked_claim(j)
        if key then
          taken[key] = true
          v.ck[key] = j.id
        end
        add('claim', j)
        vset(v, j, { state = 'active' })
        plan.n = plan.n + 1
      end
    end
  end
  -- Stopped at its bound of jobs past their deadline with slots left:
  -- due jobs may wait behind the ones left, so the workers are woken to
  -- claim again at once rather than at their next poll (as on SQL).
  if not (ended >= DEADLINE_LIMIT and plan.n < c.limit) then
    plan.wake = nil
  end
  return plan
end

-- Applies the claim's plan, counting in r the jobs it ends past their
-- deadline.
local function apply_claim(plan, c, r)
  local claimed = {}
  for _, d in ipairs(plan) do
    if d.kind == 'drop' then
      redis.call('ZREM', d.lane, d.member)
    elseif d.kind == 'park' then
      park(load(d.id), d.lane, d.member)
    elseif d.kind == 'dead' then
      local j = load(d.id)
      finish(j, 'dead', tonumber(j.attempts_used), 'deadline')
      event(j.id, 'dead', obj('reason', js('deadline')))
      ended(r, 'dead')
    else
      claimed[#claimed + 1] = claim_one(load(d.id), c)
    end
  end
  if plan.wake then
    wake(plan.wake)
  end
  return claimed
end

-- Claim arguments at `at`: limit, lease_ms, worker, nonce, queue count,
-- queues…, type count (-1 for any), types….
local function claim_args(args, at)
  local c = { limit = tonumber(args[at]), lease_ms = tonumber(args[at + 1]), worker = args[at + 2], nonce = args[at + 3], queues = {} }
  local nq = tonumber(args[at + 4])
  local i = at + 5
  for k = 1, nq do
    c.queues[k] = args[i]
    i = i + 1
  end
  local nt = tonumber(args[i])
  i = i + 1
  if nt >= 0 then
    c.types = {}
    for _ = 1, nt do
      c.types[args[i]] = true
      i = i + 1
    end
  end
  return c, i
end

-- Completions (args from `done_at`, n of them), then the claim c (nothing
-- for a limit of 0): reaping up to 1000 expired leases first, and a key
-- the completions or the reap free offering its parked job before the
-- lanes are read. Returns {completion flags, claimed jobs, what the claim
-- recorded beside (recorded())}.
local function complete_and_claim(args, done_at, n, c)
  local v = view()
  local done = plan_completions(v, args, done_at, n)
  local reaped, claims = nil, nil
  if c.limit > 0 then
    reaped = plan_reap(v, 1000)
    plan_settle(v)
    claims = plan_claim(v, c)
  end
  -- Writes only from here on.
  local flags = apply_completions(done)
  local claimed = {}
  local r = recorded()
  if claims then
    apply_reap(reaped, r)
    settle()
    claimed = apply_claim(claims, c, r)
  end
  return { flags, claimed, r }
end

-- Returns {claimed jobs, what the claim recorded beside}.
reg('claim', function(args)
  local c = claim_args(args, 3)
  local out = complete_and_claim(args, 3, 0, c)
  return { out[2], out[3] }
end)

-- args: prefix, clock, n, completions…, then the claim's arguments.
reg('complete_and_claim', function(args)
  local n = tonumber(args[3])
  local c = claim_args(args, 4 + n * 4)
  return complete_and_claim(args, 4, n, c)
end)

reg('heartbeat', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
  checked(j)
  -- The server enforces the timeout and the deadline for workers it cannot
  -- interrupt: a heartbeat past either records the attempt so.
  -- The state the job was left in follows, for the caller's counters.
  if NOW >= tonumber(j.started_at) + tonumber(j.timeout_ms) * 1000 then
    local e = end_attempt(j, { kind = 'timed_out', unit = tonumber(args[5]) })
    return { 'lease_lost', e[1] }
  end
  if N(j.deadline) and NOW >= N(j.deadline) then
    local e = end_attempt(j, { kind = 'deadline' })
    return { 'lease_lost', e[1] }
  end
  local expires = NOW + tonumber(j.lease_ms) * 1000
  redis.call('HSET', jkey(j.id), 'lease_expires_at', I(expires))
  j.lease_expires_at = I(expires)
  redis.call('ZADD', P .. 'leases', I(expires), j.id)
  return { 'ok', I(expires), j.cancel_requested == '1' and 1 or 0 }
end)

-- args: prefix, clock, id, token, error, retryable, retry_after_ms, snooze_ms, unit.
reg('fail', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
  checked(j)
  local e
  if A(args[8]) then
    e = { kind = 'snoozed', snooze = A(args[8]) }
  else
    e = { kind = 'failed', error = args[5], retryable = args[6] == '1', retry_after = A(args[7]), unit = tonumber(args[9]) }
  end
  local r = end_attempt(j, e)
  return { 'ok', r[1], r[2] }
end)

reg('release', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
  checked(j)
  local r = end_attempt(j, { kind = 'released' })
  return { 'ok', r[1] }
end)

reg('checkpoint_put', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
  local stored = redis.call('HSETNX', P .. 'cp:' .. j.id, args[5], args[6])
  if stored == 1 then
    event(j.id, 'checkpointed', obj('name', js(args[5])))
  end
  return { 'ok', stored }
end)

reg('lease_reap', function(args)
  local v = view()
  local plan = plan_reap(v, tonumber(args[3]))
  -- Writes only from here on.
  local r = recorded()
  apply_reap(plan, r)
  -- Keys with parked jobs and no holder, a sample a pass: a key released by
  -- an older version of this library, which does not unpark, is settled
  -- here.
  for _, key in ipairs(redis.call('SRANDMEMBER', P .. 'ckp', 100)) do
    FREED[key] = true
  end
  return r
end)
