import sys

from rlk3.cli import main

sys.exit(main())
