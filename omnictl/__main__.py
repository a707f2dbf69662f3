"""``python -m omnictl``: the same CLI as the ``omnictl`` console script, in the calling process."""

from omnictl.cli import main

if __name__ == "__main__":
    main()
