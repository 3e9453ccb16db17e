"""Build-time CLI: enumerate kernel variants, compile them to cubins, write and check the manifest."""
