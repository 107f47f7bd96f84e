-- wake: new work is takeable (a submit, a retry); every idle worker gets a token on its wake list.
-- KEYS[1] idle set
-- Returns the number of workers woken.
local n = redis.call('SCARD', KEYS[1])
wake_idle(KEYS[1])
return n
