"""``python -m graphpipe.bench ARGS``: the same as ``graphpipe bench ARGS``."""

from graphpipe.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
