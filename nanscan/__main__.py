import sys

from nanscan.cli import main

sys.exit(main())
