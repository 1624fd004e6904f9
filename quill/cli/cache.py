"""``quill cache list`` / ``prune`` / ``clear``: the prepacked cache (kernel layouts saved after a first load)."""

from __future__ import annotations

import time


def register(sub) -> None:
    p = sub.add_parser("cache", help="list, prune or clear the prepacked cache (kernel layouts saved after a first "
                                     "load)")
    csub = p.add_subparsers(dest="cache_command", required=True)
    for name, func, what in (("list", run_list, "list the cached models, newest first, and writers' temporary files"),
                             ("prune", run_prune, "delete unusable files and temporary files of writers that "
                                                  "stopped"),
                             ("clear", run_clear, "delete every cache file")):
        c = csub.add_parser(name, help=what)
        c.add_argument("--cache-dir", default=None,
                       help="the cache's directory (default: $QUILL_CACHE_DIR, else ~/.cache/quill)")
        c.set_defaults(func=func)


def run_list(args) -> int:
    from quill.prepacked.store import PrepackedCache
    cache = PrepackedCache(args.cache_dir)
    entries = cache.entries()
    print(f"{cache.files_dir}: {len(entries)} file(s), {sum(e.size for e in entries) / 1e6:.1f} MB")
    print(cache.room.describe(cache.files_dir))
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created))
        state = f"UNUSABLE ({e.problem})" if e.problem else f"{e.model_type}, {e.kernels}"
        print(f"  {e.path.name}  {e.size / 1e6:8.1f} MB  {when}  quill {e.built_by}  {state}\n    {e.source}")
    temps = cache.leftovers()
    if temps:
        stale = [t for t in temps if t.stale]
        print(f"leftovers: {len(temps)} temporary file(s), {sum(t.size for t in temps) / 1e6:.1f} MB"
              f" ({len(stale)} of writers that stopped: `quill cache prune` deletes them)")
        for t in temps:
            print(f"  {t.path.parent.name}/{t.describe()}")
    return 0


def run_prune(args) -> int:
    from quill.prepacked.store import PrepackedCache
    cache = PrepackedCache(args.cache_dir)
    paths, nbytes = cache.prune()
    for p in paths:
        print(f"  removed {p.parent.name}/{p.name}")
    print(f"{cache.directory}: removed {len(paths)} file(s), {nbytes / 1e6:.1f} MB")
    return 0


def run_clear(args) -> int:
    from quill.prepacked.store import PrepackedCache
    cache = PrepackedCache(args.cache_dir)
    files, nbytes = cache.clear()
    print(f"{cache.directory}: removed {files} file(s), {nbytes / 1e6:.1f} MB")
    return 0
