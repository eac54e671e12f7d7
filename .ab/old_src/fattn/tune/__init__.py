"""fattn.tune: config spaces with keep() rules (asked of the C side), the microbenchmark sweep (Top-K), the
evolutionary search with a correctness gate, the interleaved confirmation of a winner, and the tuned-config cache
writer.  Run `python -m fattn.tune --help`."""
from .search import cache_entry, confirm, evo, micro  # noqa: F401
from .space import CPUSpace, Problem, V2Space, space_for  # noqa: F401
