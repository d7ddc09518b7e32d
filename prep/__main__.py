import sys

from prep.cli import main

sys.exit(main())
