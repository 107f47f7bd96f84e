-- wake: new work is takeable (a submit, a retry); every idle worker gets a token on its wake list.
--
-- wake(
--   keys = {idle set},
--   args = {}
-- )
-- Reply (see _lib.lua): {1, 'woken', 'workers', the number of workers woken}.

local idle_key = KEYS[1]

local n = redis.call('SCARD', idle_key)
wake_idle(idle_key)
return {1, 'woken', 'workers', n}
