"""``python -m hf_arb.cli`` = ``hf-arb`` (also ``python -m hf_arb``)."""

import sys

from hf_arb.cli.app import main

sys.exit(main())
