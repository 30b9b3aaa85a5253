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

-- Records every expired lease (at most `limit`).
local function reap(limit)
  local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', I(NOW), 'LIMIT', 0, limit)
  local n = 0
  for _, id in ipairs(ids) do
    local j = load(id)
    if j and j.state == 'active' and tonumber(j.lease_expires_at) <= NOW then
      end_attempt(j, { kind = 'lease_expired' })
      n = n + 1
    elseif not j or j.state ~= 'active' then
      -- An entry its job left behind: drop it.
      redis.call('ZREM', P .. 'leases', id)
    end
  end
  return n
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

-- Claims up to c.limit due jobs: highest priority first, then oldest
-- run_at, then acceptance, across the waiting lists of the queues and
-- types asked for (one list per queue, priority and type).
local function claim(c)
  local claimed = {}
  if c.limit <= 0 then
    return claimed
  end
  reap(1000)
  -- A key freed by the reap or by this call's completions offers its
  -- parked job before the lanes are read.
  settle()
  local queues = c.queues
  if #queues == 0 then
    queues = redis.call('SMEMBERS', P .. 'queues')
  end
  local lists = {}
  for _, q in ipairs(queues) do
    if redis.call('HGET', P .. 'paused', q) ~= '1' then
      local fields = redis.call('HKEYS', P .. 'wl:' .. q)
      for _, f in ipairs(fields) do
        local bar = string.find(f, '|', 2, true)
        local prio, jtype = tonumber(f:sub(1, bar - 1)), f:sub(bar + 1)
        if not c.types or c.types[jtype] then
          lists[#lists + 1] = { key = P .. 'w:' .. q .. '|' .. f, prio = prio, buf = {}, pos = 1, done = false }
        end
      end
    end
  end
  local function head(l)
    if l.pos > #l.buf and not l.done then
      -- Every entry read before has left the lane (claimed, parked or
      -- dropped), so the next page starts at the lane's head again.
      l.buf = redis.call('ZRANGEBYSCORE', l.key, '-inf', I(NOW), 'WITHSCORES', 'LIMIT', 0, PAGE)
      l.pos = 1
      if #l.buf < PAGE * 2 then
        l.done = true
      end
    end
    if l.pos > #l.buf then
      return nil
    end
    return l.buf[l.pos], tonumber(l.buf[l.pos + 1])
  end
  local taken = {}
  local skipped, ended = 0, 0
  local ended_queue = nil
  while #claimed < c.limit and skipped < SKIP_LIMIT and ended < DEADLINE_LIMIT do
    local best, bm, bs = nil, nil, nil
    for _, l in ipairs(lists) do
      local m, s = head(l)
      if m then
        local better = best == nil or l.prio > best.prio
          or (l.prio == best.prio and (s < bs or (s == bs and m:sub(1, 16) < bm:sub(1, 16))))
        if better then
          best, bm, bs = l, m, s
        end
      end
    end
    if not best then
      break
    end
    best.pos = best.pos + 2
    local id = bm:sub(17)
    local j = load(id)
    if not j or j.state ~= 'waiting' then
      -- An entry its job left behind: drop it.
      redis.call('ZREM', best.key, bm)
    elseif j.concurrency_key and not taken[j.concurrency_key]
      and redis.call('EXISTS', P .. 'ck:' .. j.concurrency_key) == 1 then
      -- Its key is held by a job that was active before this claim: not a
      -- candidate at all (as on SQL), so a passed deadline is left for the
      -- claim that finds the key free. Parked until then.
      park(j, best.key, bm)
      skipped = skipped + 1
    elseif N(j.deadline) and N(j.deadline) <= NOW then
      -- Past its deadline: never started.
      finish(j, 'dead', tonumber(j.attempts_used), 'deadline')
      event(id, 'dead', obj('reason', js('deadline')))
      ended = ended + 1
      ended_queue = j.queue
    elseif j.concurrency_key and taken[j.concurrency_key] then
      -- Its key was taken by this claim: parked until that job ends.
      park(j, best.key, bm)
      skipped = skipped + 1
    else
      if j.concurrency_key then
        taken[j.concurrency_key] = true
      end
      claimed[#claimed + 1] = claim_one(j, c)
    end
  end
  -- Stopped at its bound of jobs past their deadline with slots left:
  -- due jobs may wait behind the ones left, so the workers are woken to
  -- claim again at once rather than at their next poll (as on SQL).
  if ended >= DEADLINE_LIMIT and #claimed < c.limit then
    wake(ended_queue)
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

reg('claim', function(args)
  local c = claim_args(args, 3)
  return claim(c)
end)

-- Completions: args from `at` are (id, token, has result, result) × n.
local function complete_all(args, at, n)
  local out = {}
  for k = 0, n - 1 do
    local i = at + k * 4
    local j = load_active(args[i], args[i + 1])
    if j then
      local result = nil
      if args[i + 2] == '1' then
        result = args[i + 3]
      end
      end_attempt(j, { kind = 'completed', result = result })
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return out
end

-- args: prefix, clock, n, completions…, then the claim's arguments.
reg('complete_and_claim', function(args)
  local n = tonumber(args[3])
  local done = complete_all(args, 4, n)
  local c = claim_args(args, 4 + n * 4)
  return { done, claim(c) }
end)

reg('heartbeat', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
  -- The server enforces the timeout and the deadline for workers it cannot
  -- interrupt: a heartbeat past either records the attempt so.
  if NOW >= tonumber(j.started_at) + tonumber(j.timeout_ms) * 1000 then
    end_attempt(j, { kind = 'timed_out', unit = tonumber(args[5]) })
    return { 'lease_lost' }
  end
  if N(j.deadline) and NOW >= N(j.deadline) then
    end_attempt(j, { kind = 'deadline' })
    return { 'lease_lost' }
  end
  local expires = NOW + tonumber(j.lease_ms) * 1000
  redis.call('HSET', jkey(j.id), 'lease_expires_at', I(expires))
  redis.call('ZADD', P .. 'leases', I(expires), j.id)
  return { 'ok', I(expires), j.cancel_requested == '1' and 1 or 0 }
end)

-- args: prefix, clock, id, token, error, retryable, retry_after_ms, snooze_ms, unit.
reg('fail', function(args)
  local j = load_active(args[3], args[4])
  if not j then
    return { 'lease_lost' }
  end
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
  local n = reap(tonumber(args[3]))
  -- Keys with parked jobs and no holder, a sample a pass: a key released by
  -- an older version of this library, which does not unpark, is settled
  -- here.
  for _, key in ipairs(redis.call('SRANDMEMBER', P .. 'ckp', 100)) do
    FREED[key] = true
  end
  return n
end)
