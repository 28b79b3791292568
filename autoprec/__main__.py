import sys

from autoprec.cli import main

sys.exit(main())
