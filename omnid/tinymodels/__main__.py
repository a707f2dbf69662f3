"""``python -m omnid.tinymodels [--force] ROOT``: build every tiny model under ROOT."""

import sys

from omnid.tinymodels import main

if __name__ == "__main__":
    sys.exit(main())
