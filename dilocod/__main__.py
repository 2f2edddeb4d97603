import sys

from dilocod.cli import main

sys.exit(main())
