"""One root outside a save: one writer (ownership), start-up recovery, removal, moving damage aside, gc."""
