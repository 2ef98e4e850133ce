"""The bus client every service uses: connect, provision, publish, consume, dead-letter."""
