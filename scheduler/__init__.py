"""The fleet model, the pure scheduling core and the store (models and migrations).

Nothing here imports from the rest of the project (DESIGN.md, "The folders").
"""
