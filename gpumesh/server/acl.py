"""The Redis ACL rules of the broker's roles (what `gpumesh serve` and `gpumesh access add` give each user).

Redis checks every command a script or function runs against its caller's ACL, so a worker must be
allowed, key by key, whatever gpumesh's functions do on its behalf. What the rules take away:

* from workers and submitters: Lua of their own (``EVAL``, ``EVALSHA``, ``SCRIPT``, ``FUNCTION``: one
  loop would freeze Redis until ``SHUTDOWN NOSAVE``); they call only the library that `serve` loads
  (``FCALL``). And ``PUBLISH`` (RQ's stop and kill commands to a worker), the broker's epoch (a changed
  epoch stops every worker), the result-signing keys (``keys.RESULT_KEYS``);
* from workers also: writing job indexes, scripts and submit bookkeeping (read-only to them), and the
  commands that destroy or replace a key whatever its type (``DEL``, ``RENAME``, ``SET``, ``EXPIRE``,
  ``*STORE``...) except on the few families their flow deletes or replaces (leases, wake lists, the idle
  set, their registration, staged output files, RQ's keys); a job's spent set takes ``SADD`` only.

SECURITY.md ("What each credential can do") lists, command by command, what each role may do; tests/server/test_worker_credential.py
runs that table against a real broker.

Every key pattern here is made from store/keys.py (a family's function called with ``"*"``), so the rules
follow the layout wherever it is defined.
"""

from __future__ import annotations

from gpumesh.store import keys

# What every non-admin role is denied whatever else it is given (categories, then commands).
_NEVER = ["-@admin", "-@dangerous", "-@scripting", "-@pubsub", "-acl"]

# RQ needs INFO (server version) and CLIENT SETNAME/INFO (its worker's name and address).
_CLIENT = ["+info", "+client|setname", "+client|info", "+client|getname"]

# Commands that delete, replace or put a TTL on a key whatever its type holds: a worker runs them only
# on the families of _WORKER_REPLACES.
_DESTROYERS = [
    "del", "unlink", "rename", "renamenx", "copy", "move", "set", "setex", "psetex", "mset", "msetnx", "getset",
    "getdel", "getex", "expire", "pexpire", "expireat", "pexpireat", "persist", "sunionstore", "sinterstore",
    "sdiffstore", "zunionstore", "zinterstore", "zdiffstore", "zrangestore", "georadius", "georadiusbymember",
    "geosearchstore", "bitop", "pfmerge",
]  # fmt: skip

# Key families a worker writes (its functions' writes included): tasks (hash, log stream, output files),
# leases, its job's counters, pending sets and streams of ends, worker registrations and the fleet,
# placement and wake-up state (the holders of each env too), events and statistics, the reaper's lock.
_WORKER_WRITES = [
    keys.task("*"),
    keys.lease("*"),
    keys.LEASES,
    keys.job("*"),
    keys.worker("*"),
    keys.WORKERS,
    keys.SCORES,
    keys.FLEET,
    keys.READY,
    keys.IDLE,
    keys.wake("*"),
    keys.EVENTS,
    keys.STATS,
    keys.STATS_ALL,
    keys.REAPER_LOCK,
    keys.env_holders("*"),
]

# Families a worker may delete or expire: one selector, since a multi-key DEL (a worker leaving deletes
# its registration, wake list and RQ queue at once) must find all its keys in one.
_WORKER_REPLACES = [
    keys.lease("*"),
    keys.REAPER_LOCK,
    keys.IDLE,
    keys.wake("*"),
    keys.worker("*"),
    keys.task_files_staging("*", "*"),
    "rq:*",
]
_DELETERS = ["del", "unlink", "getdel", "expire", "pexpire", "expireat", "pexpireat", "persist"]
# Of those, the families a worker may also replace whatever they hold (SET and the *STORE commands): the
# strings it owns. Not the idle set or a registration: SET on them would turn a set or hash into a string
# and break every function that reads them.
_WORKER_SETS = [keys.lease("*"), keys.REAPER_LOCK, "rq:*"]

# Submitters write everything of gpumesh's but the epoch and the result-signing keys (project files too:
# workers only read them).
_SUBMITTER_WRITES = [
    keys.job("*"),
    keys.JOBS,
    keys.STAGING,
    keys.task("*"),
    keys.script("*"),
    keys.READY,
    keys.IDLE,
    keys.wake("*"),
    keys.EVENTS,
    keys.spent("*"),
    keys.lease("*"),
    keys.LEASES,
    keys.STATS,
    keys.STATS_ALL,
    keys.PROJECT_ALL,
]

# FCALL asks for read and write access to every key it names, but does nothing with them itself: each
# command the function runs is checked against the caller's rules on its own. So gpumesh's functions may
# name any of gpumesh's keys (the heartbeat names the epoch, which workers only read; complete names the
# job's spent set, which takes only SADD from workers) without widening what the caller may do to them.
_FCALL = f"(~{keys.ALL} ~rq:* +fcall +fcall_ro)"

_DATA = ["+@read", "+@write", "+@keyspace", "+@hash", "+@list", "+@set", "+@sortedset", "+@stream", "+@string"]

SUBMITTER = [
    "resetkeys", "resetchannels", f"%R~{keys.ALL}", *[f"~{k}" for k in _SUBMITTER_WRITES], "~rq:*",
    "-@all", *_DATA, "+@transaction", "+@connection", "+@fast", *_NEVER, "-@blocking", "+xread", *_CLIENT, _FCALL,
]  # fmt: skip

WORKER = [
    "resetkeys", "resetchannels", "&rq:pubsub:*", f"%R~{keys.ALL}", *[f"~{k}" for k in _WORKER_WRITES], "~rq:*",
    "-@all", *_DATA, "+@transaction", "+@connection", "+@fast", "+@blocking", *_NEVER,
    *[f"-{c}" for c in _DESTROYERS], "+subscribe", "+unsubscribe", "+psubscribe", "+punsubscribe", *_CLIENT,
    # selectors: each allows its commands on its keys only
    _FCALL,
    "(" + " ".join([*[f"~{k}" for k in _WORKER_REPLACES], *[f"+{c}" for c in _DELETERS]]) + ")",
    "(" + " ".join([*[f"~{k}" for k in _WORKER_SETS], *[f"+{c}" for c in _DESTROYERS if "rename" not in c]]) + ")",
    # a winning copy's staged files become the task's (complete): RENAME reads and deletes its source, so
    # the kept files (write only here) can be a destination, never a source (renamed away, then deleted)
    f"(%RW~{keys.task_files_staging('*', '*')} %W~{keys.task_files('*')} +rename)",
    f"(~{keys.task_files('*')} +persist)",  # and lose the staged files' TTL
    f"(~{keys.spent('*')} +sadd)",  # a completed signed task's index joins its job's spent set (complete)
    f"(~{keys.env_holders('*')} +pexpire)",  # a holders set goes a day after it was last named (env_held)
    "(~rq:* +rename +renamenx)",  # RQ's own bookkeeping
]  # fmt: skip

ADMIN = ["~*", "&*", "+@all"]

ROLES: dict[str, list[str]] = {"submitter": SUBMITTER, "worker": WORKER}


def line(user: str, secret: str, rules: list[str], state: str = "on") -> str:
    """A users.acl line; ``secret`` as Redis takes it: ``>password`` or ``#sha256`` (ACL SAVE's form)."""
    return " ".join(["user", user, state, secret, *rules])


def secret_and_state(acl_line: str) -> tuple[list[str], str]:
    """The password tokens (``#hash`` or ``>password``) and on/off of a users.acl line (its root part:
    selectors, in parentheses, never hold passwords)."""
    root = acl_line.split("(", 1)[0].split()[2:]
    secrets = [t for t in root if t.startswith(("#", ">")) or t == "nopass"]
    state = "off" if "off" in root else "on"
    return secrets, state
