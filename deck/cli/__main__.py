"""``python -m deck.cli``: the ``deck`` command (e.g. under ``torchrun -m deck.cli merge``)."""

import sys

from deck.cli import main

sys.exit(main())
