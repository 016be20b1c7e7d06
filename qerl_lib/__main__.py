import sys

from qerl_lib.cli import main

sys.exit(main())
