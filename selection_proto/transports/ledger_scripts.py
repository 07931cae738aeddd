"""The ledger's Lua scripts (docs/REPLICATION.md): what each call does inside Valkey/Redis, in one
atomic step: init, a batch of a replica's changes, the reaper, a snapshot, a replica's join.
`transports/ledger.py` runs them; `sim/ledger.py` mirrors `BATCH` in process."""

from __future__ import annotations

from typing import Final

__all__ = ["BATCH", "GONE_MAX", "INIT", "JOIN", "REAP", "SCRIPTS", "SNAPSHOT"]

GONE_MAX: Final = 65_536  # ended bookings the ledger remembers, newest first: a retried free answers 404

# Every script checks the epoch first: a ledger that came back empty is noticed on the next write.
_PRELUDE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- origin: the replica that made the change; whose: the replica whose booking it is about
local function emit(origin, kind, ident, body, whose)
  local n = redis.call('INCR', KEYS[9])
  local id = redis.call('XADD', KEYS[10], 'MAXLEN', '~', ARGV[5], '*',
                        'n', n, 'o', origin, 'k', kind, 'i', ident, 'b', body, 'w', whose or '')
  redis.call('SET', KEYS[11], id)
  return n
end
local function book(origin, ident, body, rk, lease)
  redis.call('HSET', KEYS[1], ident, body)
  redis.call('HSET', KEYS[13], ident, origin)
  redis.call('ZADD', KEYS[4], now + lease, ident)
  redis.call('ZREM', KEYS[14], ident)
  redis.call('HINCRBY', KEYS[6], rk, 1)
  return emit(origin, 'add', ident, body, origin)
end
-- A booking ended at feed position n. It is remembered (the newest GONE_MAX), so that a retried
-- free of it is told so rather than taken for a free that came before its booking. A booking of
-- the same id that waited behind it (made on another replica before this end arrived) starts now.
local function retire(ident, n, lease)
  redis.call('HDEL', KEYS[1], ident)
  redis.call('HDEL', KEYS[2], ident)
  redis.call('HDEL', KEYS[3], ident)
  redis.call('HDEL', KEYS[13], ident)
  redis.call('ZREM', KEYS[4], ident)
  redis.call('ZADD', KEYS[14], n, ident)
  redis.call('ZREMRANGEBYRANK', KEYS[14], 0, -(GONE_MAX + 1))
  local waiting = redis.call('HGET', KEYS[16], ident)
  if waiting then
    redis.call('HDEL', KEYS[16], ident)
    local w = cmsgpack.unpack(waiting)  -- origin, body, rank key, prefilled, progress body, count
    book(w[1], ident, w[2], w[3], lease)
    if w[4] == 1 then
      redis.call('HSET', KEYS[2], ident, '')
      emit(w[1], 'prefill', ident, '', w[1])
    end
    if w[6] > 0 then
      redis.call('HSET', KEYS[3], ident, cjson.encode({[w[1]] = w[6]}))
      emit(w[1], 'progress', ident, w[5], w[1])
    end
  end
end
""".replace("GONE_MAX", str(GONE_MAX))

INIT: Final = """
if redis.call('EXISTS', KEYS[8]) == 0 then redis.call('SET', KEYS[8], ARGV[1]) end
return redis.call('GET', KEYS[8])
"""

# ARGV: epoch, origin, lease ms, tombstone ms, feed length, then per op (kind, id, body, rank key
# or, for prefill and progress, the booking's replica, count, view).
# An id is one booking at a time. A free names its booking's replica, so it never ends another
# booking of the id. A booking of an id still held (its free is on its way from another replica)
# waits behind it and starts when it ends. An early free (of an id the ledger never held, or not
# lately) leaves a tombstone fenced at its own place in the feed: it refuses the one booking of
# that id made on a view before it (its replica had not seen the free), never one made after.
# Order decides; the clock only bounds how long a tombstone is kept.
BATCH: Final = "if redis.call('GET', KEYS[8]) ~= ARGV[1] then return {'epoch'} end" + _PRELUDE + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
for _, ident in ipairs(expired) do
  redis.call('ZREM', KEYS[5], ident)
  redis.call('HDEL', KEYS[15], ident)
end
local origin, lease, tomb = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i = 6, #ARGV, 6 do
  local kind, ident, body, rk, count, view = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local owner = redis.call('HGET', KEYS[13], ident)
  local raw = redis.call('HGET', KEYS[16], ident)
  local waiting = raw and cmsgpack.unpack(raw)
  local mine = waiting and waiting[1] == (kind == 'free' and body or rk)  -- an op on the waiting one
  local r
  if kind == 'add' then
    local fence = tonumber(redis.call('HGET', KEYS[15], ident) or '-1')
    if owner == origin or (waiting and waiting[1] == origin) then r = 'ok 0'  -- a retried write
    elseif owner and waiting then r = 'dup'  -- a third booking of one id: ids are unique while live
    elseif owner then
      redis.call('HSET', KEYS[16], ident, cmsgpack.pack({origin, body, rk, 0, '', 0}))
      r = 'queued'
    elseif fence >= 0 and tonumber(view) < fence then
      -- made before its replica saw the free: the free's booking. One free ends one booking.
      redis.call('ZREM', KEYS[5], ident)
      redis.call('HDEL', KEYS[15], ident)
      retire(ident, emit(origin, 'free', ident, '', origin), lease)  -- its free's replica answers it now
      r = 'freed'
    elseif count ~= '' and tonumber(redis.call('HGET', KEYS[6], rk) or '0') ~= tonumber(count) then
      r = 'conflict ' .. (redis.call('GET', KEYS[9]) or '0')
    else
      r = 'ok ' .. book(origin, ident, body, rk, lease)
    end
  elseif kind == 'prefill' or kind == 'progress' then
    if mine and owner ~= rk then  -- kept with the waiting booking, published when it starts
      if kind == 'prefill' then waiting[4] = 1
      elseif tonumber(count) > waiting[6] then waiting[5], waiting[6] = body, tonumber(count) end
      redis.call('HSET', KEYS[16], ident, cmsgpack.pack(waiting))
      r = 'ok 0'
    elseif not owner then r = 'missing'
    elseif rk ~= '' and owner ~= rk then r = 'stale'  -- another booking of the id
    elseif kind == 'prefill' then
      redis.call('HSET', KEYS[2], ident, '')
      r = 'ok ' .. emit(origin, kind, ident, '', owner)
    else  -- output blocks per reporting replica, absolute each
      local counts = cjson.decode(redis.call('HGET', KEYS[3], ident) or '{}')
      if (counts[origin] or 0) < tonumber(count) then counts[origin] = tonumber(count) end
      redis.call('HSET', KEYS[3], ident, cjson.encode(counts))
      r = 'ok ' .. emit(origin, kind, ident, body, owner)
    end
  elseif kind == 'free' then
    -- body: the replica that made the booking ('' when unknown: a written-through free)
    if mine and owner ~= body then
      redis.call('HDEL', KEYS[16], ident)  -- the waiting booking ends before it started
      r = 'ok 0'
    elseif body ~= '' and owner and owner ~= body then
      r = 'stale'  -- the id was booked again by another replica meanwhile: not this free's booking
    elseif owner then
      local n = emit(origin, kind, ident, '', owner)
      retire(ident, n, lease)
      r = 'ok ' .. n
    elseif body ~= '' or redis.call('ZSCORE', KEYS[14], ident) then
      r = 'gone'  -- its booking has ended already: a retried free
    else
      local n = emit(origin, 'tomb', ident, '')
      redis.call('ZADD', KEYS[5], now + tomb, ident)
      redis.call('HSET', KEYS[15], ident, n)
      r = 'tombstoned ' .. n
    end
  elseif kind == 'worker' then
    if count ~= '' and redis.call('HEXISTS', KEYS[7], ident) == 1 then
      r = 'ok 0'  -- a seed (a record given back after a reset) never overwrites a newer write
    else
      redis.call('HSET', KEYS[7], ident, body)
      r = 'ok ' .. emit(origin, kind, ident, body)
    end
  else
    return redis.error_reply('unknown op ' .. kind)
  end
  out[#out + 1] = r
end
return out
"""

# ARGV: epoch, origin, limit, lease ms, feed length
REAP: Final = "if redis.call('GET', KEYS[8]) ~= ARGV[1] then return -1 end" + _PRELUDE + """
local due = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
for _, ident in ipairs(due) do
  retire(ident, emit(ARGV[2], 'expire', ident, '', redis.call('HGET', KEYS[13], ident)), tonumber(ARGV[4]))
end
return #due
"""

# The waiting bookings go as their replicas: each keeps its own, which the ledger will start.
# ARGV: the feed position the replica has applied; the ids ended after it go too (`gone`, with
# where they ended), which its mirror may never have seen.
SNAPSHOT: Final = """
local waiting = {}
for i, v in ipairs(redis.call('HGETALL', KEYS[16])) do
  if i % 2 == 1 then waiting[#waiting + 1] = v else waiting[#waiting + 1] = cmsgpack.unpack(v)[1] end
end
return {redis.call('GET', KEYS[8]), redis.call('GET', KEYS[9]), redis.call('GET', KEYS[11]),
        redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
        redis.call('HGETALL', KEYS[6]), redis.call('HGETALL', KEYS[7]), redis.call('HGETALL', KEYS[13]),
        waiting, redis.call('ZRANGEBYSCORE', KEYS[14], '(' .. ARGV[1], '+inf', 'WITHSCORES')}
"""


# ARGV: origin, registry record, its `binding` string, now (s), freshness (s). Atomic, so that of
# two replicas starting at once with different settings the second is refused.
JOIN: Final = """
local entries = redis.call('HGETALL', KEYS[12])
for i = 1, #entries, 2 do
  if entries[i] ~= ARGV[1] then
    local ok, record = pcall(cjson.decode, entries[i + 1])
    if ok and type(record) == 'table' and type(record.binding) == 'string' and type(record.seen) == 'number'
        and tonumber(ARGV[4]) - record.seen <= tonumber(ARGV[5]) and record.binding ~= ARGV[3] then
      return {entries[i], record.binding}
    end
  end
end
redis.call('HSET', KEYS[12], ARGV[1], ARGV[2])
return {}
"""

SCRIPTS: Final = {"init": INIT, "batch": BATCH, "reap": REAP, "snapshot": SNAPSHOT, "join": JOIN}
