-- ACQUIRE_OR_MARK: ACQUIRE, the grant taking the key's marks; or, when another holder's
-- lease is live, leave a mark for it and arm a watch if none is armed.
-- KEYS[1]  lease hash {holder, token}
-- KEYS[2]  token counter
-- KEYS[3]  marks set
-- KEYS[4]  watch flag
-- KEYS[5]  note left by the last holder that released the key
-- ARGV[1]  holder
-- ARGV[2]  ttl_ms
-- ARGV[3]  counter_ttl_ms
-- ARGV[4]  mark
-- ARGV[5]  marks_ttl_ms
-- ARGV[6]  watch_slack_ms: the watch outlives the live lease by this much
-- returns  {1, token, server_now_ms, {marks...}, note} when granted (note taken: absent
--          when there was none),
--          {0, remaining_ms, watch (1 when this call armed it)} when busy
--#include now_ms
local current = redis.call('HGET', KEYS[1], 'holder')
if current and current ~= ARGV[1] then
  redis.call('SADD', KEYS[3], ARGV[4])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[5]))
  local remaining = redis.call('PTTL', KEYS[1])
  if remaining < 0 then remaining = 0 end
  local armed = redis.call('SET', KEYS[4], '1', 'NX', 'PX', remaining + tonumber(ARGV[6]))
  return {0, remaining, armed and 1 or 0}
end
--#include grant
redis.call('DEL', KEYS[4])
local marks = redis.call('SMEMBERS', KEYS[3])
redis.call('DEL', KEYS[3])
local note = redis.call('GET', KEYS[5])
if note then
  redis.call('DEL', KEYS[5])
  return {1, token, now_ms, marks, note}
end
return {1, token, now_ms, marks}
