"""Thin shim so `python train.py ...` works from a clone; the app is `steadylm.train`."""

from steadylm.train import main

if __name__ == "__main__":
    main()
