"""``python -m inkling_fp4`` (and ``torchrun -m inkling_fp4``) runs the CLI."""

from inkling_fp4.cli import main

if __name__ == "__main__":
    main()
