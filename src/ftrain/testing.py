"""`ft.testing`: assertions for unit-testing your own training steps."""
