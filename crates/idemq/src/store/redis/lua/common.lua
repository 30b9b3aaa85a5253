-- idemq on Redis: helpers shared by every function of the library.
--
-- Every function is called as `FCALL <name> 0 <prefix> <test clock> <args…>`.
-- Rules kept throughout (a function that errors after a write keeps the
-- write, Redis has no rollback):
--   * decide first (every read and check), then write with commands that
--     cannot fail;
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

local function jkey(id)
  return P .. 'job:' .. id
end

local function load(id)
  local raw = redis.call('HGETALL', jkey(id))
  if #raw == 0 then
    return nil
  end
  local j = {}
  for i = 1, #raw, 2 do
    j[raw[i]] = raw[i + 1]
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

local function ddname(jtype, key)
  return jtype .. '|' .. key
end

local function dkkey(j)
  return P .. 'dk:' .. ddname(j.type, j.dedupe_key)
end

-- Reads a dedupe binding.
local function read_dd(jtype, key)
  local r = redis.call('HMGET', P .. 'dd:' .. ddname(jtype, key), 'job', 'mode', 'ttl', 'mw', 'acc', 'wu')
  if not r[1] then
    return nil
  end
  return { job = r[1], mode = r[2], ttl = N(r[3]), mw = N(r[4]), acc = tonumber(r[5]), wu = N(r[6]) }
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

-- If no active job holds `key`, puts the best parked job of each of its
-- lanes back in that lane; an entry whose job no longer waits parked there
-- is dropped on the way.
local function unpark(key)
  if redis.call('EXISTS', P .. 'ck:' .. key) == 1 then
    return
  end
  local l = P .. 'ckwl:' .. key
  for _, lf in ipairs(redis.call('HKEYS', l)) do
    for _ = 1, 100 do
      local top = redis.call('ZRANGE', ckw(key, lf), 0, 0)
      if #top == 0 then
        redis.call('HDEL', l, lf)
        break
      end
      local member = top[1]
      unlist_parked(key, lf, member)
      local j = load(member:sub(17))
      if j and j.state == 'waiting' and j.parked and j.concurrency_key == key
        and lfield(j) == lf and wmember(j) == member then
        redis.call('HDEL', jkey(j.id), 'parked')
        redis.call('ZADD', wkey(j), j.run_at, member)
        WOKEN[j.queue] = true
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
  return keyed_of(j.state, tonumber(j.attempt), tonumber(j.run_at))
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
