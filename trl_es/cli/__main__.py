"""``python -m trl_es.cli`` (and ``accelerate launch -m trl_es.cli``): the ``trl-es`` console script."""

import sys

from . import main


sys.exit(main())
