import sys

from miles_multilora.cli import main

sys.exit(main())
