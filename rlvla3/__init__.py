"""rlvla3 package."""
