"""Where adapter metadata lives: the SQL schema, engines and migrations."""
