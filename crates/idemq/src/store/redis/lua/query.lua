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

-- The bytes of a job view's members and values.
local function view_bytes(view)
  local n = 0
  for _, v in ipairs(view) do
    n = n + #v
  end
  return n
end

-- args: prefix, clock, stored state, due ('1', '0' or ''), queue, type,
-- tag, cursor, limit, and a bound in bytes ('' for none). Returns {now,
-- next cursor or '', job views…}. The jobs come newest first from one index
-- (a state's, a queue's) or, with neither filter, from every queue's index
-- merged by sequence number. The views answered hold at most the bound's
-- bytes of members and values, unless the first alone holds more: a job
-- past the bound starts the next page, so the reply stays bounded however
-- large the jobs are.
reg('job_list', function(args)
  local state, due, queue, jtype, tag = args[3], args[4], args[5], args[6], args[7]
  local limit = tonumber(args[9])
  local max_bytes = tonumber(args[10])
  local bytes, cut = 0, false
  local keys, page = nil, 256
  if state ~= '' then
    keys = { P .. 'st:' .. state }
  elseif queue ~= '' then
    keys = { P .. 'qj:' .. queue }
  else
    keys = {}
    for _, q in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
      keys[#keys + 1] = P .. 'qj:' .. q
    end
    -- Most pages take their jobs from few queues: a first read of each
    -- as long as the page.
    page = math.min(page, limit + 1)
  end
  local top = '+inf'
  if args[8] ~= '' then
    top = '(' .. args[8]
  end
  local sources = {}
  for i, k in ipairs(keys) do
    sources[i] = { key = k, max = top, page = page, buf = {}, pos = 1, done = false }
  end
  -- The next (id, seq) of a source, reading it a page at a time.
  local function head(src)
    if src.pos > #src.buf and not src.done then
      src.buf = redis.call('ZREVRANGEBYSCORE', src.key, src.max, '-inf', 'WITHSCORES', 'LIMIT', 0, src.page)
      src.pos = 1
      if #src.buf < src.page * 2 then
        src.done = true
      else
        src.max = '(' .. src.buf[#src.buf]
      end
      src.page = 256
    end
    if src.pos > #src.buf then
      return nil
    end
    return src.buf[src.pos], tonumber(src.buf[src.pos + 1])
  end
  local jobs, seqs = {}, {}
  local scanned = 0
  local last = nil
  local exhausted = false
  while #jobs <= limit and scanned < SCAN_LIMIT + limit do
    local best, id, seq = nil, nil, nil
    for _, src in ipairs(sources) do
      local i, s = head(src)
      if i and (best == nil or s > seq) then
        best, id, seq = src, i, s
      end
    end
    if not best then
      exhausted = true
      break
    end
    best.pos = best.pos + 2
    scanned = scanned + 1
    local j = load(id)
    if j then
      last = j.seq
      local ok = (state == '' or j.state == state)
        and (due == '' or (due == '1') == (tonumber(j.run_at) <= NOW))
        and (queue == '' or j.queue == queue)
        and (jtype == '' or j.type == jtype)
        and (tag == '' or has_tag(j.tags, tag))
      if ok then
        local view = job_view(j)
        if max_bytes then
          local size = view_bytes(view)
          if #jobs > 0 and bytes + size > max_bytes then
            cut = true
            break
          end
          bytes = bytes + size
        end
        jobs[#jobs + 1] = view
        seqs[#seqs + 1] = j.seq
      end
    end
  end
  local out = { I(NOW), '' }
  if cut then
    out[2] = seqs[#jobs]
  elseif #jobs > limit then
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
    local c = redis.call('HMGET', P .. 'cnt:' .. q, 'active', 'completed', 'dead', 'cancelled')
    -- The waiting jobs are counted by lane.
    local lanes = redis.call('HGETALL', P .. 'wl:' .. q)
    local waiting, scheduled = 0, 0
    for i = 1, #lanes, 2 do
      local n = tonumber(lanes[i + 1])
      if n > 0 then
        waiting = waiting + n
        scheduled = scheduled + redis.call('ZCOUNT', P .. 'w:' .. q .. '|' .. lanes[i], '(' .. I(NOW), '+inf')
      end
    end
    local active, completed, dead, cancelled = N(c[1]) or 0, N(c[2]) or 0, N(c[3]) or 0, N(c[4]) or 0
    local total = waiting + active + completed + dead + cancelled
    if total > 0 or is_paused[q] ~= nil then
      out[#out + 1] = { q, is_paused[q] and 1 or 0, scheduled, waiting - scheduled, active,
        completed, dead, cancelled }
    end
  end
  return out
end, true)
