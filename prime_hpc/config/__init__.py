"""A run's config: the typed schema (`schema`), composition from `conf/` (`compose`), its
checks (`validate`) and what each component is started with (`component`)."""
