-- Operator actions: cancel, purge, promote, redrive, pause, binding
-- release, and the bounded maintenance sweeps.

local function cancel_waiting(j)
  finish(j, 'cancelled', tonumber(j.attempts_used), nil)
  release_dedupe(j)
  event(j.id, 'cancelled', '{}')
end

local function request_cancel(j)
  if j.cancel_requested ~= '1' then
    save(j, { cancel_requested = '1', updated_at = NOW })
    event(j.id, 'cancel_requested', '{}')
  end
end

reg('cancel', function(args)
  local j = load(args[3])
  if not j then
    return { 'not_found' }
  end
  if PENDING[j.state] then
    checked(j)
  end
  if j.state == 'waiting' then
    cancel_waiting(j)
    return { 'ok', 1, 'cancelled' }
  elseif j.state == 'active' then
    request_cancel(j)
    return { 'ok', 1, 'active' }
  end
  return { 'ok', 0, derived(j) }
end)

reg('cancel_by_key', function(args)
  local jtype, key = args[3], args[4]
  local ids = redis.call('SMEMBERS', P .. 'dk:' .. ddname(jtype, key))
  local jobs = {}
  for _, id in ipairs(ids) do
    local j = load(id)
    if j and PENDING[j.state] then
      jobs[#jobs + 1] = checked(j)
    end
  end
  -- Writes only from here on.
  for _, j in ipairs(jobs) do
    if j.state == 'waiting' then
      cancel_waiting(j)
    else
      request_cancel(j)
    end
  end
  if #jobs > 0 then
    redis.call('DEL', P .. 'dd:' .. ddname(jtype, key))
    redis.call('ZREM', P .. 'ddexp', ddname(jtype, key))
    return 1
  end
  return 0
end)

-- Deletes a job with its events, runs, checkpoints and the list of the
-- idempotency bindings made to it (`jk:`; bindings that outlive their job
-- are swept by their own expiry, binding_sweep).
local function delete_job(j)
  leave(j)
  redis.call('ZREM', P .. 'qj:' .. j.queue, j.id)
  redis.call('DEL', jkey(j.id), P .. 'ev:' .. j.id, P .. 'runs:' .. j.id, P .. 'cp:' .. j.id,
    P .. 'jk:' .. j.id)
  ROWS[j.id] = false
end

reg('purge', function(args)
  local j = load(args[3])
  if not j or j.state == 'active' then
    return 0
  end
  checked(j)
  local never_ran = jint(j, 'attempt') == 0
  if never_ran then
    -- The work never happened, so its keys may own new work.
    for _, name in ipairs(redis.call('SMEMBERS', P .. 'jk:' .. j.id)) do
      if redis.call('HGET', P .. 'idem:' .. name, 'job') == j.id then
        redis.call('DEL', P .. 'idem:' .. name)
        redis.call('ZREM', P .. 'idemexp', name)
      end
    end
  end
  -- A job that ran keeps its idempotency bindings until their ttl.
  delete_job(j)
  release_dedupe(j)
  return 1
end)

reg('promote', function(args)
  local j = load(args[3])
  if not j then
    return { 'not_found' }
  end
  checked(j)
  if derived(j) ~= 'scheduled' then
    return { 'ok', 0 }
  end
  move(j, { run_at = NOW, updated_at = NOW })
  event(j.id, 'promoted', '{}')
  wake(j.queue)
  return { 'ok', 1 }
end)

-- args: prefix, clock, job id, scope ('' without a key), hash, preview,
-- ttl_ms, fingerprint, max_attempts, deadline, run_at, reset checkpoints.
reg('redrive', function(args)
  local id, scope = args[3], args[4]
  -- A live redrive key decides, as an idempotency key does for enqueue.
  if scope ~= '' then
    local r = redis.call('HMGET', P .. 'idem:' .. scope .. '|' .. args[5], 'job', 'fp', 'expires')
    if r[1] and idem_until(r[1], r[3]) > NOW then
      if r[2] == args[8] then
        return { 'ok', r[1], 'replayed' }
      end
      return { 'conflict', r[1], r[2] }
    end
  end
  local j = load(id)
  if not j then
    return { 'not_found' }
  end
  checked(j)
  if j.state ~= 'dead' then
    return { 'not_dead', derived(j) }
  end
  local deadline = A(args[10])
  if deadline and deadline <= NOW then
    return { 'invalid', 'deadline' }
  end
  local run_at = A(args[11]) or NOW
  if deadline and run_at >= deadline then
    return { 'invalid', 'run_at' }
  end
  -- A passed deadline is cleared unless a new one is given.
  local new_deadline = false
  if deadline then
    new_deadline = deadline
  elseif N(j.deadline) and N(j.deadline) > NOW then
    new_deadline = j.deadline
  end
  move(j, {
    state = 'waiting', attempts_used = 0, max_attempts = A(args[9]) or j.max_attempts,
    run_at = run_at, deadline = new_deadline, finished_at = false, purge_after = false,
    cancel_requested = false, updated_at = NOW,
  })
  -- Redrive does not take dedupe bindings. A binding without a window lives
  -- while its job is pending, so one left behind by the dead job would come
  -- back to life now; it ended when the job died, so drop it.
  if j.dedupe_key then
    local name = ddname(j.type, j.dedupe_key)
    local b = redis.call('HMGET', P .. 'dd:' .. name, 'job', 'wu')
    if b[1] == j.id and not b[2] then
      redis.call('DEL', P .. 'dd:' .. name)
      redis.call('ZREM', P .. 'ddexp', name)
    end
  end
  local reset = args[12] == '1'
  if reset then
    redis.call('DEL', P .. 'cp:' .. id)
  end
  event(id, 'redriven', obj('run_at', I(run_at), 'reset_checkpoints', reset and 'true' or 'false'))
  if scope ~= '' then
    write_binding(scope .. '|' .. args[5], id, args[8], args[6], NOW + tonumber(args[7]) * 1000)
  end
  wake(j.queue)
  return { 'ok', id, 'accepted' }
end)

reg('queue_pause', function(args)
  redis.call('HSET', P .. 'paused', args[3], args[4])
  if args[4] ~= '1' then
    wake(args[3])
  end
  return 1
end)

reg('binding_release', function(args)
  local name = args[3] .. '|' .. args[4]
  local r = redis.call('HMGET', P .. 'idem:' .. name, 'job', 'preview', 'expires')
  if not r[1] or idem_until(r[1], r[3]) <= NOW then
    return 0
  end
  redis.call('DEL', P .. 'idem:' .. name)
  redis.call('ZREM', P .. 'idemexp', name)
  redis.call('SREM', P .. 'jk:' .. r[1], name)
  local purge_after = redis.call('HGET', jkey(r[1]), 'purge_after')
  if purge_after then
    -- Its retention no longer waits for this binding (the sweep pushed it
    -- out to the binding's expiry).
    redis.call('ZADD', P .. 'purge', purge_after, r[1])
  end
  if redis.call('EXISTS', jkey(r[1])) == 1 then
    event(r[1], 'binding_released', obj('scope', js(args[3]), 'key_preview', js(r[2]),
      'key_digest', js(args[4]:sub(1, 16))))
  end
  return 1
end)

-- Removes expired idempotency bindings and dedupe bindings that no longer
-- live. Decides every binding it looks at before it writes.
reg('binding_sweep', function(args)
  local limit = tonumber(args[3])
  local idem = {}
  local names = redis.call('ZRANGEBYSCORE', P .. 'idemexp', '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, name in ipairs(names) do
    local r = redis.call('HMGET', P .. 'idem:' .. name, 'job', 'expires')
    local d = { name = name, job = r[1] }
    if r[1] then
      d.expires = idem_until(r[1], r[2])
    end
    idem[#idem + 1] = d
  end
  -- One pass removes at most `limit` bindings of both kinds together.
  local rest = limit - #names
  local dd = {}
  if rest > 0 then
    names = redis.call('ZRANGEBYSCORE', P .. 'ddexp', '-inf', I(NOW), 'LIMIT', 0, rest)
    for _, name in ipairs(names) do
      local bar = string.find(name, '|', 1, true)
      local b = read_dd(name:sub(1, bar - 1), name:sub(bar + 1))
      local d = { name = name }
      if not b then
        d.act = 'forget'
      elseif not is_live(b, keyed(load(b.job))) then
        d.act = 'remove'
      elseif b.wu then
        d.act = 'later'
        d.at = b.wu
      else
        -- Lives while its job is pending: looked at again when the job ends.
        d.act = 'forget'
      end
      dd[#dd + 1] = d
    end
  end
  -- Writes only from here on.
  local removed = 0
  for _, d in ipairs(idem) do
    if d.job and d.expires > NOW then
      redis.call('ZADD', P .. 'idemexp', I(d.expires), d.name)
    else
      if d.job then
        redis.call('DEL', P .. 'idem:' .. d.name)
        redis.call('SREM', P .. 'jk:' .. d.job, d.name)
        removed = removed + 1
      end
      redis.call('ZREM', P .. 'idemexp', d.name)
    end
  end
  for _, d in ipairs(dd) do
    if d.act == 'remove' then
      redis.call('DEL', P .. 'dd:' .. d.name)
      redis.call('ZREM', P .. 'ddexp', d.name)
      removed = removed + 1
    elseif d.act == 'later' then
      redis.call('ZADD', P .. 'ddexp', I(d.at), d.name)
    else
      redis.call('ZREM', P .. 'ddexp', d.name)
    end
  end
  return removed
end)

-- Deletes terminal jobs past their retention, never one a live binding
-- points at (such a job is looked at again when that binding ends).
-- Decides every job it looks at before it writes.
reg('job_retention_sweep', function(args)
  local limit = tonumber(args[3])
  local ids = redis.call('ZRANGEBYSCORE', P .. 'purge', '-inf', I(NOW), 'LIMIT', 0, limit)
  local plan = {}
  for _, id in ipairs(ids) do
    local j = load(id)
    local d = { id = id }
    if j and not PENDING[j.state] then
      checked(j)
      local until_ = nil
      for _, name in ipairs(redis.call('SMEMBERS', P .. 'jk:' .. id)) do
        local r = redis.call('HMGET', P .. 'idem:' .. name, 'job', 'expires')
        if r[1] == id then
          local expires = idem_until(id, r[2])
          if expires > NOW then
            until_ = math.max(until_ or 0, expires)
          end
        end
      end
      if j.dedupe_key then
        local b = read_dd(j.type, j.dedupe_key)
        if b and b.job == id and b.wu and b.wu > NOW then
          until_ = math.max(until_ or 0, b.wu)
        end
      end
      d.job = j
      d.until_ = until_
    end
    plan[#plan + 1] = d
  end
  -- Writes only from here on.
  local deleted = 0
  for _, d in ipairs(plan) do
    if not d.job then
      redis.call('ZREM', P .. 'purge', d.id)
    elseif d.until_ then
      redis.call('ZADD', P .. 'purge', I(d.until_), d.id)
    else
      delete_job(d.job)
      release_dedupe(d.job)
      deleted = deleted + 1
    end
  end
  return deleted
end)

reg('key_check', function(args)
  if redis.call('HSETNX', P .. 'installation', 'key_check', args[3]) == 1 then
    redis.call('HSET', P .. 'installation', 'created_at', I(NOW), 'updated_at', I(NOW))
  end
  return redis.call('HGET', P .. 'installation', 'key_check')
end)

reg('key_check_replace', function(args)
  local previous = redis.call('HGET', P .. 'installation', 'key_check')
  redis.call('HSET', P .. 'installation', 'key_check', args[3], 'updated_at', I(NOW))
  if redis.call('HEXISTS', P .. 'installation', 'created_at') == 0 then
    redis.call('HSET', P .. 'installation', 'created_at', I(NOW))
  end
  local live = 0
  if previous ~= args[3] then
    live = redis.call('ZCOUNT', P .. 'idemexp', '(' .. I(NOW), '+inf')
  end
  return { previous or '', previous and 1 or 0, live }
end)

-- Records what `idemq migrate` installed (args: prefix, clock, layout,
-- library version, revision, idemq version), unless the installation was
-- migrated for a higher revision meanwhile: {'ok'}, or {'newer', that
-- revision, the idemq that recorded it}. One call, so two migrations at
-- once cannot leave an older library recorded over a newer one.
reg('record_migration', function(args)
  local revision = tonumber(args[5])
  local r = redis.call('MGET', P .. 'revision', P .. 'idemq')
  local recorded = tonumber(r[1])
  if recorded and recorded > revision then
    return { 'newer', r[1], r[2] or '' }
  end
  redis.call('SET', P .. 'layout', args[3])
  redis.call('SET', P .. 'version', args[4])
  redis.call('SET', P .. 'revision', args[5])
  redis.call('SET', P .. 'idemq', args[6])
  return { 'ok' }
end)

-- Brings data of an older layout (args: prefix, clock, its layout) to this
-- one; `idemq migrate` calls it before it records the new layout. Layout 2
-- keeps no index of every job (a listing merges the queues' own) and no
-- waiting count per queue (the sum of its lanes'): both are dropped.
-- Layout 3 adds the parked entries of concurrency keys (common.lua), which
-- start empty: nothing to convert from layout 2.
reg('upgrade', function(args)
  local from = tonumber(args[3])
  if from >= 1 and from < 2 then
    redis.call('UNLINK', P .. 'jobs')
    for _, q in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
      redis.call('HDEL', P .. 'cnt:' .. q, 'waiting')
    end
  end
  return 1
end)
