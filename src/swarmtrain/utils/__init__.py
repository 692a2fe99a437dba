"""Small shared helpers: logging factory, clocks, seeded RNG. Imports only stdlib and numpy."""
