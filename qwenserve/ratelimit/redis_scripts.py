"""Lua scripts of the Redis backend: the same rules as `window.py`, atomic on the server.

Per tenant two keys share a hash tag (so they land on one Redis Cluster slot):
  <prefix>:{<tenant>}:log   ZSET  member = entry id, score = charge time (server microseconds)
  <prefix>:{<tenant>}:cost  HASH  entry id -> tokens still charged; field "_total" = their sum
Entry ids always contain '#', so they never collide with "_total". Both keys expire one second
after the window following the last admission: an idle tenant leaves nothing behind.

Time comes from the Redis server's TIME, so every router process shares one clock; scripts are
replicated by effects (the default since Redis 5), which makes TIME safe to call.
"""

from __future__ import annotations

# KEYS: log, cost. ARGV: cost, max_requests (-1 = none), max_tokens (-1 = none), window_us,
# entry_id, ttl_ms. Returns "code requests tokens now_us reset_us retry_us" with code 1 = admitted,
# 0 = rejected, -1 = the cost alone exceeds max_tokens. One string, not an array: the client
# parses one reply line instead of seven, a measurable share of a decision in Python.
ADMIT = """
local log, costs = KEYS[1], KEYS[2]
local cost = tonumber(ARGV[1])
local max_requests = tonumber(ARGV[2])
local max_tokens = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local entry = ARGV[5]
local ttl_ms = tonumber(ARGV[6])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cutoff = now - window

-- Entries stamped at or before now - window no longer count: drop them and their tokens.
local expired = redis.call('ZRANGEBYSCORE', log, '-inf', cutoff)
if #expired > 0 then
  local freed = 0
  for i = 1, #expired, 512 do
    local last = math.min(i + 511, #expired)
    local vals = redis.call('HMGET', costs, unpack(expired, i, last))
    for j = 1, #vals do
      if vals[j] then freed = freed + tonumber(vals[j]) end
    end
    redis.call('HDEL', costs, unpack(expired, i, last))
  end
  redis.call('ZREMRANGEBYSCORE', log, '-inf', cutoff)
  redis.call('HINCRBY', costs, '_total', -freed)
end

local count = redis.call('ZCARD', log)
local used = tonumber(redis.call('HGET', costs, '_total') or 0)

if max_tokens >= 0 and cost > max_tokens then
  return string.format('-1 %d %d %d 0 0', count, used, now)
end
local over_requests = max_requests >= 0 and count + 1 > max_requests
local over_tokens = max_tokens >= 0 and used + cost > max_tokens
if not (over_requests or over_tokens) then
  redis.call('ZADD', log, now, entry)
  redis.call('HSET', costs, entry, cost)
  redis.call('HINCRBY', costs, '_total', cost)
  redis.call('PEXPIRE', log, ttl_ms)
  redis.call('PEXPIRE', costs, ttl_ms)
  return string.format('1 %d %d %d %d 0', count + 1, used + cost, now, window)
end

-- Rejected: the window is back to its initial state when the newest entry expires, and this
-- request fits once enough of the oldest entries have expired.
local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
local reset = 0
if #newest > 0 then reset = tonumber(newest[2]) + window - now end
local need_requests, need_tokens = 0, 0
if over_requests then need_requests = count + 1 - max_requests end
if over_tokens then need_tokens = used + cost - max_tokens end
local freed_requests, freed_tokens = 0, 0
local retry = window
local start = 0
local found = false
while not found do
  local page = redis.call('ZRANGE', log, start, start + 127, 'WITHSCORES')
  if #page == 0 then break end
  local ids = {}
  for j = 1, #page, 2 do ids[#ids + 1] = page[j] end
  local vals = redis.call('HMGET', costs, unpack(ids))
  for k = 1, #ids do
    freed_requests = freed_requests + 1
    freed_tokens = freed_tokens + (tonumber(vals[k]) or 0)
    if freed_requests >= need_requests and freed_tokens >= need_tokens then
      retry = tonumber(page[2 * k]) + window - now
      found = true
      break
    end
  end
  start = start + 128
end
if retry < 0 then retry = 0 end
return string.format('0 %d %d %d %d %d', count, used, now, reset, retry)
"""

# KEYS: log, cost. ARGV: entry_id, actual tokens. Lowers the entry's charge to the actual tokens
# (setting, not subtracting, so settling twice is harmless). Returns the tokens refunded (0 when
# the entry already left the window).
SETTLE = """
local charged = redis.call('HGET', KEYS[2], ARGV[1])
if not charged then return 0 end
local refund = tonumber(charged) - tonumber(ARGV[2])
if refund <= 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], -refund)
redis.call('HINCRBY', KEYS[2], '_total', -refund)
return refund
"""
