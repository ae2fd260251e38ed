"""``python -m graphpipe``: the command line (see ``graphpipe.cli``)."""

from graphpipe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
