-- idemq on Redis: helpers shared by every function of the library.
--
-- Every function is called as `FCALL <name> 0 <prefix> <test clock> <args…>`.
-- Rules kept throughout (a function that errors after a write keeps the
-- write, Redis has no rollback):
--   * decide first (every read and check), then write with commands that
--     cannot fail; every row a call will write is checked (checked() below)
--     before its first write, so a row it cannot read ends the call with an
--     UNREADABLE error and nothing written, as the SQL backends roll back;
--   * a microsecond timestamp never goes through tostring, `..` on a number
--     or cjson: it is formatted with I() (string.format '%d', exact below
--     2^53) or kept as the string Redis returned;
--   * the job hash holds strings only, and a missing field is NULL.

local P = ''
local NOW = 0
-- The reads of one call, with the effects of its earlier items laid over
-- them (enqueue decides a whole batch before it writes).
local O = nil
-- The queues this call has work for: each is published once, when the
-- function returns (a batch of a thousand jobs is one wake-up, not a
-- thousand).
local WOKEN = {}
-- The concurrency keys this call may have freed (their holder ended, or a
-- waiting job of theirs left): each is settled once, when the function
-- returns (settle below).
local FREED = {}
-- The job hashes this call has read, by id (false: no such job), each
-- table kept equal to the stored hash by every write of it: a row is read
-- once per call, and a row decided on is the row written.
local ROWS = {}
-- The rows (tables) this call has checked, and the retry policies (by
-- their text) it has found readable: each is checked once per call.
local CHECKED = {}
local RETRIES = {}

local function I(x)
  return string.format('%d', x)
end

-- A stored integer, or nil for a missing field.
local function N(s)
  if s == nil or s == false or s == '' then
    return nil
  end
  return tonumber(s)
end

-- An optional integer argument ('' for none).
local function A(s)
  if s == nil or s == '' then
    return nil
  end
  return tonumber(s)
end

-- Starts a call: the key prefix, and the clock of record read once.
local function begin(args)
  P = args[1]
  NOW = nil
  if args[2] == '1' then
    local t = redis.call('GET', P .. 'test_clock')
    if t then
      NOW = tonumber(t)
    end
  end
  if not NOW then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  O = { idem = {}, jobs = {}, dd = {}, writes = {} }
  WOKEN = {}
  FREED = {}
  ROWS = {}
  CHECKED = {}
  RETRIES = {}
end

-- A JSON string.
local function js(s)
  return cjson.encode(s)
end

-- A JSON object of (name, raw JSON value) pairs.
local function obj(...)
  local t = { ... }
  local out = {}
  for i = 1, #t, 2 do
    out[#out + 1] = js(t[i]) .. ':' .. t[i + 1]
  end
  return '{' .. table.concat(out, ',') .. '}'
end

-- Ends the call, before its first write, on a stored value it cannot act
-- on: the store reads the UNREADABLE error as the Backend error naming the
-- record and the field (crate::job::Undecodable) that the SQL backends
-- give for an unreadable row. `kind` is `invalid`, `unreadable`, `unknown`
-- or `null`.
local function unreadable(row, column, kind, what, value, detail)
  error({ err = 'UNREADABLE ' .. cjson.encode({
    row = row, column = column, kind = kind, what = what,
    value = value or cjson.null, detail = detail or cjson.null,
  }) })
end

-- A stored integer as a number, or nil when `s` is not integer text
-- (what Rust's i64 parse takes, within 2^63).
local function int_of(s)
  if type(s) ~= 'string' or #s > 20 or not s:match('^[-+]?%d+$') then
    return nil
  end
  return tonumber(s)
end

-- A stored integer that must read as one (nil stays nil when optional);
-- `row` and `column` name it in the error.
local function stored_int(s, row, column, optional)
  if s == nil or s == false then
    if optional then
      return nil
    end
    unreadable(row, column, 'null', 'value')
  end
  local n = int_of(s)
  if n == nil then
    unreadable(row, column, 'invalid', 'a non-integer value', s)
  end
  return n
end

local function jkey(id)
  return P .. 'job:' .. id
end

-- Job `id`'s hash (nil when there is none), read once per call (ROWS).
local function load(id)
  local j = ROWS[id]
  if j ~= nil then
    return j or nil
  end
  local raw = redis.call('HGETALL', jkey(id))
  if #raw == 0 then
    ROWS[id] = false
    return nil
  end
  j = {}
  for i = 1, #raw, 2 do
    j[raw[i]] = raw[i + 1]
  end
  ROWS[id] = j
  return j
end

-- Integer field `f` of job j, which must read as one.
local function jint(j, f)
  return stored_int(j[f], 'job ' .. tostring(j.id), 'job.' .. f)
end

local JOB_STATES = { waiting = true, active = true, completed = true, dead = true, cancelled = true }
-- The fields of a job hash a function may compute with or write back:
-- text every job has, integers every job has, integers it may have, and
-- what an active job has besides.
local JOB_TEXT = { 'id', 'type', 'queue', 'payload', 'retry', 'tags' }
local JOB_INTS = {
  'priority', 'run_at', 'attempt', 'attempts_used', 'max_attempts', 'timeout_ms', 'seq',
  'created_at', 'updated_at',
}
local JOB_OPT_INTS = {
  'first_run_at', 'deadline', 'keep_ms', 'lease_expires_at', 'lease_ms', 'started_at',
  'claim_seq', 'done_seq', 'finished_at', 'purge_after',
}
local ACTIVE_INTS = { 'lease_expires_at', 'lease_ms', 'started_at' }

-- The fields a retry policy of each kind must have as numbers
-- (crate::RetryPolicy as serde writes it).
local RETRY_NUMBERS = {
  exponential = { 'initial_ms', 'factor', 'max_ms' },
  fixed = { 'delay_ms' },
  none = {},
}

-- JSON field `f` of job j, decoded; unreadable JSON ends the call.
local function jjson(j, f, what)
  local ok, v = pcall(cjson.decode, j[f])
  if not ok then
    unreadable('job ' .. j.id, 'job.' .. f, 'unreadable', what, j[f], tostring(v))
  end
  return v
end

-- Job j, once every field a function computes with or writes back reads
-- as what it must be; else the call ends (unreadable) before any write.
-- Called on every row a call will write, before the call's first write.
-- Ends the call on field f of job j (its name built only then).
local function bad_field(j, f, kind, what, value, detail)
  unreadable('job ' .. tostring(j.id), 'job.' .. f, kind, what, value, detail)
end

-- Field f of job j must read as an integer (or be absent, if optional).
local function int_field(j, f, optional)
  local s = j[f]
  if s == nil or s == false then
    if not optional then
      bad_field(j, f, 'null', 'value')
    end
  elseif int_of(s) == nil then
    bad_field(j, f, 'invalid', 'a non-integer value', s)
  end
end

local function checked(j)
  if CHECKED[j] then
    return j
  end
  for _, f in ipairs(JOB_TEXT) do
    if j[f] == nil then
      bad_field(j, f, 'null', 'value')
    end
  end
  if not JOB_STATES[j.state] then
    if j.state == nil then
      bad_field(j, 'state', 'null', 'value')
    end
    bad_field(j, 'state', 'unknown', 'state', j.state)
  end
  for _, f in ipairs(JOB_INTS) do
    int_field(j, f)
  end
  for _, f in ipairs(JOB_OPT_INTS) do
    int_field(j, f, true)
  end
  if j.state == 'active' then
    for _, f in ipairs(ACTIVE_INTS) do
      int_field(j, f)
    end
  end
  if not RETRIES[j.retry] then
    local r = jjson(j, 'retry', 'retry policy')
    local numbers = type(r) == 'table' and RETRY_NUMBERS[r.kind]
    if not numbers then
      bad_field(j, 'retry', 'unreadable', 'retry policy', j.retry, 'not a retry policy')
    end
    for _, f in ipairs(numbers) do
      if type(r[f]) ~= 'number' then
        bad_field(j, 'retry', 'unreadable', 'retry policy', j.retry, 'no number ' .. f)
      end
    end
    RETRIES[j.retry] = true
  end
  CHECKED[j] = true
  return j
end

-- checked(j), and the JSON a claim answers with decodes (the store decodes
-- it after the call, when nothing could be taken back).
local function checked_claim(j)
  checked(j)
  jjson(j, 'payload', 'payload')
  local tags = jjson(j, 'tags', 'tags')
  local list = type(tags) == 'table' and j.tags:match('^%s*%[')
  if list then
    for _, t in pairs(tags) do
      if type(t) ~= 'string' then
        list = false
      end
    end
  end
  if not list then
    unreadable('job ' .. j.id, 'job.tags', 'unreadable', 'tags', j.tags, 'not a list of strings')
  end
  return j
end

-- Writes the changes `ch` (false deletes a field) to the job's hash and to j.
local function save(j, ch)
  local set, del = {}, {}
  for k, v in pairs(ch) do
    if v == false then
      del[#del + 1] = k
      j[k] = nil
    else
      if type(v) == 'number' then
        v = I(v)
      end
      set[#set + 1] = k
      set[#set + 1] = v
      j[k] = v
    end
  end
  if #set > 0 then
    redis.call('HSET', jkey(j.id), unpack(set))
  end
  if #del > 0 then
    redis.call('HDEL', jkey(j.id), unpack(del))
  end
end

local PENDING = { waiting = true, active = true }

local function wfield(j)
  return j.priority .. '|' .. j.type
end

local function wkey(j)
  return P .. 'w:' .. j.queue .. '|' .. wfield(j)
end

-- Members of a waiting list sort by acceptance among equal run_at.
local function wmember(j)
  return string.format('%016d', tonumber(j.seq)) .. j.id
end

-- The expiry of an idempotency binding of job `job`, which must read.
local function idem_until(job, expires)
  return stored_int(expires, 'idempotency binding of job ' .. job, 'idem.expires')
end

-- Binds idempotency binding `name` to job `id` until `expires` (a binding
-- there is expired: a live one decides the request). `jk:<job>` lists
-- exactly the bindings made to the job, so the name leaves the list of a
-- job it was bound to before, and no list outlives its job.
local function write_binding(name, id, fp, preview, expires)
  local k = P .. 'idem:' .. name
  local old = redis.call('HGET', k, 'job')
  if old and old ~= id then
    redis.call('SREM', P .. 'jk:' .. old, name)
  end
  redis.call('HSET', k, 'job', id, 'fp', fp, 'preview', preview, 'created', I(NOW), 'expires', I(expires))
  redis.call('ZADD', P .. 'idemexp', I(expires), name)
  redis.call('SADD', P .. 'jk:' .. id, name)
end

local function ddname(jtype, key)
  return jtype .. '|' .. key
end

local function dkkey(j)
  return P .. 'dk:' .. ddname(j.type, j.dedupe_key)
end

local DD_MODES = { pending = true, throttle = true, debounce = true, replace = true }

-- Reads a dedupe binding; one that does not read ends the call.
local function read_dd(jtype, key)
  local r = redis.call('HMGET', P .. 'dd:' .. ddname(jtype, key), 'job', 'mode', 'ttl', 'mw', 'acc', 'wu')
  if not r[1] then
    return nil
  end
  local row = 'dedupe binding of job ' .. r[1]
  if not DD_MODES[r[2]] then
    if not r[2] then
      unreadable(row, 'dd.mode', 'null', 'value')
    end
    unreadable(row, 'dd.mode', 'unknown', 'dedupe mode', r[2])
  end
  return {
    job = r[1], mode = r[2], ttl = stored_int(r[3], row, 'dd.ttl', true),
    mw = stored_int(r[4], row, 'dd.mw', true), acc = stored_int(r[5], row, 'dd.acc'),
    wu = stored_int(r[6], row, 'dd.wu', true),
  }
end

-- Removes the dedupe binding `name` if job `id` holds it (the generation
-- rule: a job never frees a key another job now holds).
local function release_dedupe(j)
  if not j.dedupe_key then
    return
  end
  local name = ddname(j.type, j.dedupe_key)
  if redis.call('HGET', P .. 'dd:' .. name, 'job') == j.id then
    redis.call('DEL', P .. 'dd:' .. name)
    redis.call('ZREM', P .. 'ddexp', name)
  end
end

-- Parked jobs. A due waiting job whose concurrency key is held by an
-- active job cannot be claimed until the key frees; a claim that meets one
-- moves its entry out of its lane into the key's parked entries, so later
-- claims do not scan past it again (a backlog of one key would otherwise
-- hide every job behind it). It stays waiting and counted in its lane's
-- count (`wl:`), its hash marked `parked`. When the key frees, the best
-- parked job of each of the key's lanes (by run_at, then acceptance) goes
-- back to that lane: the key admits one active job, and one candidate per
-- lane lets a claim of any queue and type find the key's next job (a
-- paused queue's or an unclaimed type's candidate cannot hold up others).
--   `ckw:<key>|<queue>|<priority>|<type>` (zset run_at → the lane member),
--   `ckwl:<key>` (hash `<queue>|<priority>|<type>` → count),
--   `ckp` (set of the keys with any).
local function lfield(j)
  return j.queue .. '|' .. wfield(j)
end

local function ckw(key, lf)
  return P .. 'ckw:' .. key .. '|' .. lf
end

local function unlist_parked(key, lf, member)
  if redis.call('ZREM', ckw(key, lf), member) == 0 then
    return
  end
  local l = P .. 'ckwl:' .. key
  if redis.call('HINCRBY', l, lf, -1) <= 0 then
    redis.call('HDEL', l, lf)
    if redis.call('EXISTS', l) == 0 then
      redis.call('SREM', P .. 'ckp', key)
    end
  end
end

-- Moves a waiting job's entry from its lane (`lane`, `member`) to its
-- key's parked entries.
local function park(j, lane, member)
  local key, lf = j.concurrency_key, lfield(j)
  redis.call('ZREM', lane, member)
  redis.call('ZADD', ckw(key, lf), j.run_at, member)
  redis.call('HINCRBY', P .. 'ckwl:' .. key, lf, 1)
  redis.call('SADD', P .. 'ckp', key)
  redis.call('HSET', jkey(j.id), 'parked', '1')
  j.parked = '1'
end

-- Whether job j waits parked under `key` in lane `lf` as entry `member`
-- (an entry it left behind is not). Reads no field it could fail on: a
-- row whose lane or member cannot be computed is taken as its entry says,
-- so its claim meets it and reports it (unreadable) rather than it being
-- lost here, where the call may have written already.
local function parked_here(j, key, lf, member)
  if not (j and j.state == 'waiting' and j.parked and j.concurrency_key == key) then
    return false
  end
  if j.queue and j.priority and j.type and lfield(j) ~= lf then
    return false
  end
  return not int_of(j.seq) or wmember(j) == member
end

-- If no active job holds `key`, puts the best parked job of each of its
-- lanes back in that lane (at the run_at it was parked with); an entry
-- whose job no longer waits parked there is dropped on the way. Cannot
-- fail on a job's fields (parked_here), so it may run after a call's
-- writes (settle).
local function unpark(key)
  if redis.call('EXISTS', P .. 'ck:' .. key) == 1 then
    return
  end
  local l = P .. 'ckwl:' .. key
  for _, lf in ipairs(redis.call('HKEYS', l)) do
    for _ = 1, 100 do
      local top = redis.call('ZRANGE', ckw(key, lf), 0, 0, 'WITHSCORES')
      if #top == 0 then
        redis.call('HDEL', l, lf)
        break
      end
      local member = top[1]
      unlist_parked(key, lf, member)
      local j = load(member:sub(17))
      if parked_here(j, key, lf, member) then
        redis.call('HDEL', jkey(j.id), 'parked')
        j.parked = nil
        redis.call('ZADD', P .. 'w:' .. lf, top[2], member)
        if j.queue then
          WOKEN[j.queue] = true
        end
        break
      end
    end
  end
  if redis.call('EXISTS', l) == 0 then
    redis.call('SREM', P .. 'ckp', key)
  end
end

-- Settles the keys this call may have freed.
local function settle()
  for key in pairs(FREED) do
    unpark(key)
  end
  FREED = {}
end

-- Adds a job to the indexes of its state.
local function enter(j)
  local s = j.state
  if s == 'waiting' then
    if j.parked then
      -- Left by a library that did not unpark: a job enters its lane.
      redis.call('HDEL', jkey(j.id), 'parked')
      j.parked = nil
    end
    redis.call('ZADD', wkey(j), j.run_at, wmember(j))
    redis.call('HINCRBY', P .. 'wl:' .. j.queue, wfield(j), 1)
  elseif s == 'active' then
    redis.call('ZADD', P .. 'leases', j.lease_expires_at, j.id)
    if j.concurrency_key then
      redis.call('SET', P .. 'ck:' .. j.concurrency_key, j.id)
    end
  else
    redis.call('ZADD', P .. 'purge', j.purge_after, j.id)
    -- A binding without a window stops living with its job: the sweep
    -- looks at it from now on.
    if j.dedupe_key and s ~= 'cancelled' then
      local name = ddname(j.type, j.dedupe_key)
      local b = redis.call('HMGET', P .. 'dd:' .. name, 'job', 'wu')
      if b[1] == j.id and not b[2] then
        redis.call('ZADD', P .. 'ddexp', I(NOW), name)
      end
    end
  end
  if PENDING[s] and j.dedupe_key then
    redis.call('SADD', dkkey(j), j.id)
  end
  redis.call('ZADD', P .. 'st:' .. s, j.seq, j.id)
  -- The waiting count of a queue is the sum of its lanes' (wl:).
  if s ~= 'waiting' then
    redis.call('HINCRBY', P .. 'cnt:' .. j.queue, s, 1)
  end
end

-- Removes a job from the indexes of its state.
local function leave(j)
  local s = j.state
  if s == 'waiting' then
    if j.parked then
      unlist_parked(j.concurrency_key, lfield(j), wmember(j))
      redis.call('HDEL', jkey(j.id), 'parked')
      j.parked = nil
    else
      redis.call('ZREM', wkey(j), wmember(j))
    end
    if j.concurrency_key then
      FREED[j.concurrency_key] = true
    end
    local wl = P .. 'wl:' .. j.queue
    if redis.call('HINCRBY', wl, wfield(j), -1) <= 0 then
      redis.call('HDEL', wl, wfield(j))
    end
  elseif s == 'active' then
    redis.call('ZREM', P .. 'leases', j.id)
    if j.concurrency_key then
      local ck = P .. 'ck:' .. j.concurrency_key
      if redis.call('GET', ck) == j.id then
        redis.call('DEL', ck)
        FREED[j.concurrency_key] = true
      end
    end
  else
    redis.call('ZREM', P .. 'purge', j.id)
  end
  if PENDING[s] and j.dedupe_key then
    redis.call('SREM', dkkey(j), j.id)
  end
  redis.call('ZREM', P .. 'st:' .. s, j.id)
  if s ~= 'waiting' then
    redis.call('HINCRBY', P .. 'cnt:' .. j.queue, s, -1)
  end
end

-- Changes a job's fields and moves it between the indexes.
local function move(j, ch)
  leave(j)
  save(j, ch)
  enter(j)
end

local function nextseq()
  return redis.call('INCR', P .. 'seq')
end

local function event_at(seq, id, kind, at, data)
  redis.call('RPUSH', P .. 'ev:' .. id, I(seq) .. ' ' .. at .. ' ' .. kind .. ' ' .. data)
end

local function event(id, kind, data)
  event_at(nextseq(), id, kind, I(NOW), data)
end

local function wake(queue)
  WOKEN[queue] = true
end

-- Where a job stands for dedupe (crate::dedupe::KeyedJob).
local function keyed_of(state, attempt, run_at)
  if state == nil then
    return { kind = 'missing' }
  elseif state == 'waiting' then
    return { kind = 'waiting', started = attempt > 0, due = run_at <= NOW }
  elseif state == 'active' then
    return { kind = 'active' }
  elseif state == 'cancelled' then
    return { kind = 'cancelled' }
  end
  return { kind = 'finished' }
end

local function keyed(j)
  if not j then
    return keyed_of(nil)
  end
  return keyed_of(j.state, jint(j, 'attempt'), jint(j, 'run_at'))
end

-- Liveness of a binding (crate::dedupe::Binding::is_live).
local function is_live(b, kj)
  if not b.wu then
    return kj.kind == 'waiting' or kj.kind == 'active'
  end
  return NOW < b.wu and kj.kind ~= 'cancelled'
end

-- The public state of a stored one.
local function derived(j)
  if j.state == 'waiting' then
    if tonumber(j.run_at) <= NOW then
      return 'ready'
    end
    return 'scheduled'
  end
  return j.state
end

local function keep_us(j, state)
  local keep = N(j.keep_ms)
  if not keep then
    if state == 'dead' then
      keep = KEEP_DEAD_MS
    else
      keep = KEEP_COMPLETED_MS
    end
  end
  return keep * 1000
end

-- Moves a job to a terminal state other than completed.
local function finish(j, state, used, err)
  local ch = {
    state = state, finished_at = NOW, purge_after = NOW + keep_us(j, state),
    attempts_used = used, updated_at = NOW, lease_token = false, lease_expires_at = false,
    lease_ms = false, worker = false, started_at = false, claim_seq = false,
  }
  if err then
    ch.last_error = err
  end
  move(j, ch)
end

-- Registers a function of this library version.
local function reg(name, fn, readonly)
  local flags = {}
  if readonly then
    flags = { 'no-writes' }
  end
  redis.register_function {
    function_name = 'idemq_' .. VERSION .. '_' .. name,
    callback = function(keys, args)
      begin(args)
      local r = fn(args)
      settle()
      for queue in pairs(WOKEN) do
        redis.call('PUBLISH', P .. 'wake', queue)
      end
      return r
    end,
    flags = flags,
  }
end

reg('now', function()
  return I(NOW)
end, true)
