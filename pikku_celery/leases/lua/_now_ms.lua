-- Shared by every script (included with --#include now_ms): server time in epoch ms.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
