-- RELEASE_OR_TAKE_MARKS: hand a lease back. With marks left on the key, take them and keep
-- the lease (renewed); else delete the lease, leaving the note (if any) for the next grant.
-- Only if holder and token still match.
-- KEYS[1]  lease hash
-- KEYS[2]  token counter
-- KEYS[3]  marks set
-- KEYS[4]  note
-- ARGV[1]  holder
-- ARGV[2]  token
-- ARGV[3]  ttl_ms
-- ARGV[4]  counter_ttl_ms
-- ARGV[5]  note ('' for none: an older note is deleted)
-- ARGV[6]  note_ttl_ms
-- ARGV[7]  announcement channel ('' for none): PUBLISH on it first, whoever's grant it is
-- returns  {-1} not this grant's, {0} released, {1, {marks...}} marks taken, lease kept
if ARGV[7] ~= nil and ARGV[7] ~= '' then
  -- pcall: a user whose ACL forbids the channel loses the announcement, not the hand-back
  redis.pcall('PUBLISH', ARGV[7], 'done')
end
local held = redis.call('HMGET', KEYS[1], 'holder', 'token')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return {-1}
end
local marks = redis.call('SMEMBERS', KEYS[3])
if #marks > 0 then
  redis.call('DEL', KEYS[3])
  redis.call('PEXPIRE', KEYS[1], math.max(1, tonumber(ARGV[3])))
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
  return {1, marks}
end
redis.call('DEL', KEYS[1])
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[4], ARGV[5], 'PX', tonumber(ARGV[6]))
else
  redis.call('DEL', KEYS[4])
end
return {0}
