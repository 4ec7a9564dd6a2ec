"""Instructors' answers to every exercise of the course, one module per notebook.

The notebooks are stored with their exercises unsolved. ``tests/test_solutions.py`` runs every
answer here through the notebook's own check, so an answer that stops passing is caught. The
functions that communicate live in modules, as a student's must (spawn sends them by name).
"""
