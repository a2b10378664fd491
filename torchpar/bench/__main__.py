"""Dispatch ``python -m torchpar.bench <suite>`` to ``torchpar.bench.<suite>.main``."""
import importlib
import pkgutil
import sys

import torchpar.bench as _pkg


def suites():
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in suites():
        print(f"usage: python -m torchpar.bench {{{','.join(suites())}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(f"torchpar.bench.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
