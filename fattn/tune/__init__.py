"""fattn.tune: config spaces with keep() rules, the microbenchmark sweep (Top-K), the evolutionary search with a
correctness gate, and the tuned-config cache writer.  Run `python -m fattn.tune --help`."""
from .search import cache_entry, evo, micro  # noqa: F401
from .space import CPUSpace, Problem, V2Space, space_for  # noqa: F401
