"""`diffattn compare --data`: the budgeted, resumable, paired study on a user's text."""
