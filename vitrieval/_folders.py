"""Where the subpackages live in the repository: each of vitrieval's subpackages is a
top-level folder of the checkout, installed as `vitrieval.<folder>` (setup.py maps them;
the tests that read the source walk the same folders)."""

SUBPACKAGE_FOLDERS = ("training", "index", "service", "distributed")
