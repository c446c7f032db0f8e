-- RELEASE: delete the lease only if holder and token still match.
-- KEYS[1]  lease hash
-- ARGV[1]  holder
-- ARGV[2]  token
-- returns  1 when deleted, 0 when the lease is gone or belongs to another grant
local held = redis.call('HMGET', KEYS[1], 'holder', 'token')
if held[1] == ARGV[1] and held[2] == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
