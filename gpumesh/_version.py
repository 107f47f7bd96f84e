"""gpumesh's versions: the package's, and the protocol it speaks to the broker.

The **protocol** is the broker-side contract: the Redis functions' names and arguments, the key layout and
what each field means. It changes only when that contract does, so releases that share it work side by side
whatever else they change. A broker serves its own protocol and the one before it (OLDEST_PROTOCOL), so a
mesh upgrades one machine at a time; a client two protocols apart exits at start saying which side to
upgrade (docs/how-to/upgrade.md).

A leaf module: the package's ``__init__`` and the sandbox launcher import it, so it imports nothing.
"""

__version__ = "0.3.0"

# The broker-side contract this release speaks (counted from the start of gpumesh's history;
# docs/explanation/protocol.md lists the changes). A change to a function's KEYS or ARGV, a key's name or type, or a field's meaning is a new one.
PROTOCOL = 29

# The oldest protocol this release still serves (`gpumesh serve` loads its library beside this one's) and calls
# itself when a broker serves nothing newer: PROTOCOL - 1, whose library is kept frozen in gpumesh/store/protocols/.
OLDEST_PROTOCOL = 28
