"""What produces the numbers in docs/results: the demo, the Figure-2 sweep and its plots, and the benchmarks
behind `midlayer bench`.

May import every layer. Nothing in the library imports it.
"""
