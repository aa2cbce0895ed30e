"""The differential fuzzer: random combinations of the package's options and the Lightning tools
users run beside them, each checked against a float64 reference loop that shares no code with the
package (``reference.py``). ``python -m tests.differential --help`` for the long run."""
