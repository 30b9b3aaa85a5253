-- Schedules (docs/schedules.md): definitions, due schedules and fired ticks.

local function skey(name)
  return P .. 'sch:' .. name
end

-- The next interval tick after `now` (crate::schedule::every_next).
local function every_next(anchor, every_ms, now)
  anchor = math.floor(anchor / 1000000) * 1000000
  local period = every_ms * 1000
  if period <= 0 then
    return nil
  end
  local k = 1
  if now >= anchor then
    k = math.floor((now - anchor) / period) + 1
  end
  return anchor + k * period
end

local function set_next(name, next)
  if next then
    redis.call('HSET', skey(name), 'next_fire_at', I(next))
    redis.call('ZADD', P .. 'schdue', I(next), name)
  else
    redis.call('HDEL', skey(name), 'next_fire_at')
    redis.call('ZREM', P .. 'schdue', name)
  end
end

-- args: prefix, clock, name, cron, every_ms, timezone, job, paused, at,
-- cron_next. A schedule whose timing is unchanged and that was not paused
-- keeps its next fire; any other change computes it afresh.
reg('schedule_put', function(args)
  local name, cron, every, tz, job = args[3], args[4], A(args[5]), args[6], args[7]
  local paused, at, cron_next = args[8] == '1', tonumber(args[9]), A(args[10])
  local old = redis.call('HMGET', skey(name), 'cron', 'every_ms', 'timezone', 'created_at', 'next_fire_at')
  local exists = old[4] ~= false
  local row = 'schedule ' .. js(name)
  local anchor = at
  if exists then
    anchor = stored_int(old[4], row, 'sch.created_at')
  end
  local fresh = cron_next
  if every then
    fresh = every_next(anchor, every, at)
  end
  local next = fresh
  if paused then
    next = nil
  elseif exists and old[5] and (old[1] or '') == cron and N(old[2]) == every and old[3] == tz then
    next = stored_int(old[5], row, 'sch.next_fire_at')
  end
  local k = skey(name)
  if not exists then
    redis.call('HSET', k, 'name', name, 'created_at', I(at))
    redis.call('SADD', P .. 'schedules', name)
  end
  redis.call('HSET', k, 'timezone', tz, 'job', job, 'paused', paused and '1' or '0', 'updated_at', I(at))
  if cron ~= '' then
    redis.call('HSET', k, 'cron', cron)
    redis.call('HDEL', k, 'every_ms')
  else
    redis.call('HSET', k, 'every_ms', I(every))
    redis.call('HDEL', k, 'cron')
  end
  set_next(name, next)
  return exists and 0 or 1
end)

reg('schedule_delete', function(args)
  local n = redis.call('DEL', skey(args[3]))
  redis.call('SREM', P .. 'schedules', args[3])
  redis.call('ZREM', P .. 'schdue', args[3])
  return n
end)

reg('schedule_list', function(args)
  local out = {}
  for _, name in ipairs(redis.call('SMEMBERS', P .. 'schedules')) do
    out[#out + 1] = redis.call('HGETALL', skey(name))
  end
  return out
end, true)

reg('schedule_due', function(args)
  local out = { I(NOW) }
  local names = redis.call('ZRANGEBYSCORE', P .. 'schdue', '-inf', I(NOW), 'LIMIT', 0, tonumber(args[3]))
  for _, name in ipairs(names) do
    out[#out + 1] = redis.call('HGETALL', skey(name))
  end
  return out
end, true)

-- args: prefix, clock, name, cron, every_ms, timezone, fired_at, next, error
-- ('' for none each; error is preceded by a flag).
reg('schedule_mark_fired', function(args)
  local name, cron, every, tz = args[3], args[4], A(args[5]), args[6]
  local fired, next = A(args[7]), A(args[8])
  local has_error, err = args[9] == '1', args[10]
  local s = redis.call('HMGET', skey(name), 'cron', 'every_ms', 'timezone', 'next_fire_at', 'last_fired_at')
  -- Ticks of one timing only move forward, so the next fire never moves
  -- back either (a slower scheduler's mark changes nothing).
  if not s[4] or (s[1] or '') ~= cron or N(s[2]) ~= every or s[3] ~= tz then
    return 0
  end
  local row = 'schedule ' .. js(name)
  local last = stored_int(s[5], row, 'sch.last_fired_at', true)
  if fired and last and last > fired then
    return 0
  end
  if next then
    next = math.max(stored_int(s[4], row, 'sch.next_fire_at'), next)
  end
  -- Writes only from here on.
  local k = skey(name)
  if fired then
    redis.call('HSET', k, 'last_fired_at', I(fired))
  end
  set_next(name, next)
  if has_error then
    redis.call('HSET', k, 'last_error', err, 'last_error_at', I(NOW))
  elseif fired then
    redis.call('HDEL', k, 'last_error', 'last_error_at')
  end
  return 1
end)
