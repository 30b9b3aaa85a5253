-- Read-only queries: jobs, their history, checkpoints, bindings and queue
-- counts. States are derived from the clock of record on every read.

-- A job's hash as flat pairs, with what a row only references: '~idem' (the
-- expiry of its live idempotency binding) and '~dd' (the mode and window of
-- the dedupe binding it holds).
local function job_view(j)
  local out = {}
  for k, v in pairs(j) do
    out[#out + 1] = k
    out[#out + 1] = v
  end
  if j.idem_scope then
    local r = redis.call('HMGET', P .. 'idem:' .. j.idem_scope .. '|' .. j.idem_key_hash, 'job', 'expires')
    if r[1] == j.id and tonumber(r[2]) > NOW then
      out[#out + 1] = '~idem'
      out[#out + 1] = r[2]
    end
  end
  if j.dedupe_key then
    local b = read_dd(j.type, j.dedupe_key)
    if b and b.job == j.id and is_live(b, keyed(j)) then
      out[#out + 1] = '~dd_mode'
      out[#out + 1] = b.mode
      if b.wu then
        out[#out + 1] = '~dd_wu'
        out[#out + 1] = I(b.wu)
      end
    end
  end
  return out
end

reg('job_get', function(args)
  local j = load(args[3])
  if not j then
    return { I(NOW) }
  end
  return { I(NOW), job_view(j) }
end, true)

-- Candidates a page looks at, at most, beyond its limit: a filter that
-- matches few jobs ends a page early, with a cursor to go on from.
local SCAN_LIMIT = 5000

local function has_tag(tags, tag)
  for _, t in ipairs(cjson.decode(tags)) do
    if t == tag then
      return true
    end
  end
  return false
end

-- args: prefix, clock, stored state, due ('1', '0' or ''), queue, type,
-- tag, cursor, limit. Returns {now, next cursor or '', job views…}.
reg('job_list', function(args)
  local state, due, queue, jtype, tag = args[3], args[4], args[5], args[6], args[7]
  local limit = tonumber(args[9])
  local index = P .. 'jobs'
  if state ~= '' then
    index = P .. 'st:' .. state
  elseif queue ~= '' then
    index = P .. 'qj:' .. queue
  end
  local max = '+inf'
  if args[8] ~= '' then
    max = '(' .. args[8]
  end
  local jobs, seqs = {}, {}
  local scanned = 0
  local last = nil
  local exhausted = false
  while #jobs <= limit and scanned < SCAN_LIMIT + limit do
    local page = redis.call('ZREVRANGEBYSCORE', index, max, '-inf', 'LIMIT', 0, 256)
    if #page == 0 then
      exhausted = true
      break
    end
    for _, id in ipairs(page) do
      local j = load(id)
      scanned = scanned + 1
      if j then
        last = j.seq
        max = '(' .. j.seq
        local ok = (state == '' or j.state == state)
          and (due == '' or (due == '1') == (tonumber(j.run_at) <= NOW))
          and (queue == '' or j.queue == queue)
          and (jtype == '' or j.type == jtype)
          and (tag == '' or has_tag(j.tags, tag))
        if ok then
          jobs[#jobs + 1] = job_view(j)
          seqs[#seqs + 1] = j.seq
          if #jobs > limit then
            break
          end
        end
      end
      if scanned >= SCAN_LIMIT + limit then
        break
      end
    end
    if #page < 256 and #jobs <= limit and scanned < SCAN_LIMIT + limit then
      exhausted = true
      break
    end
  end
  local out = { I(NOW), '' }
  if #jobs > limit then
    jobs[#jobs] = nil
    out[2] = seqs[limit]
  elseif not exhausted and last then
    out[2] = last
  end
  for _, v in ipairs(jobs) do
    out[#out + 1] = v
  end
  return out
end, true)

-- {job hash pairs, stored events}: the routine events are derived from the
-- hash by the caller.
reg('job_events', function(args)
  return { redis.call('HGETALL', jkey(args[3])), redis.call('LRANGE', P .. 'ev:' .. args[3], 0, -1) }
end, true)

reg('job_runs', function(args)
  return { redis.call('HGETALL', jkey(args[3])), redis.call('LRANGE', P .. 'runs:' .. args[3], 0, -1) }
end, true)

reg('checkpoint_list', function(args)
  return redis.call('HGETALL', P .. 'cp:' .. args[3])
end, true)

reg('checkpoint_get', function(args)
  return redis.call('HGET', P .. 'cp:' .. args[3], args[4])
end, true)

reg('binding_lookup', function(args)
  local r = redis.call('HMGET', P .. 'idem:' .. args[3] .. '|' .. args[4], 'job', 'preview', 'expires')
  if r[1] and tonumber(r[3]) > NOW then
    return { r[1], r[2], r[3] }
  end
  return {}
end, true)

reg('dedupe_lookup', function(args)
  local b = read_dd(args[3], args[4])
  if b and is_live(b, keyed(load(b.job))) then
    return { b.job, b.mode, b.wu and I(b.wu) or '' }
  end
  return {}
end, true)

-- Per queue: name, paused, scheduled, ready, active, completed, dead, cancelled.
reg('queue_list', function(args)
  local names = {}
  for _, q in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    names[q] = true
  end
  local paused = redis.call('HGETALL', P .. 'paused')
  local is_paused = {}
  for i = 1, #paused, 2 do
    names[paused[i]] = true
    is_paused[paused[i]] = paused[i + 1] == '1'
  end
  local out = {}
  for q in pairs(names) do
    local c = redis.call('HMGET', P .. 'cnt:' .. q, 'waiting', 'active', 'completed', 'dead', 'cancelled')
    local waiting = N(c[1]) or 0
    local scheduled = 0
    if waiting > 0 then
      for _, f in ipairs(redis.call('HKEYS', P .. 'wl:' .. q)) do
        scheduled = scheduled + redis.call('ZCOUNT', P .. 'w:' .. q .. '|' .. f, '(' .. I(NOW), '+inf')
      end
    end
    local total = waiting + (N(c[2]) or 0) + (N(c[3]) or 0) + (N(c[4]) or 0) + (N(c[5]) or 0)
    if total > 0 or is_paused[q] ~= nil then
      out[#out + 1] = { q, is_paused[q] and 1 or 0, scheduled, waiting - scheduled,
        N(c[2]) or 0, N(c[3]) or 0, N(c[4]) or 0, N(c[5]) or 0 }
    end
  end
  return out
end, true)
