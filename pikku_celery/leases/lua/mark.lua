-- MARK: leave a mark on a key, held or not.
-- KEYS[1]  marks set
-- ARGV[1]  mark
-- ARGV[2]  marks_ttl_ms
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
