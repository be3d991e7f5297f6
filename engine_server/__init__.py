"""Engine server: wraps one inference engine, serves its OpenAI API and Motor's management plane."""
