from pbsd.cli import app

app(prog_name="pbsd")
