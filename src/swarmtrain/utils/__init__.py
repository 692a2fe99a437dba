"""Small shared helpers: logging factory, seeded RNG. Imports only stdlib and numpy."""
