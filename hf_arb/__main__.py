"""``python -m hf_arb`` is the ``hf-arb`` command."""

import sys

from hf_arb.cli.app import main

sys.exit(main())
