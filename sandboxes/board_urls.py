"""Board URLs, included in the console's namespace."""

from django.urls import path

from . import board_views

urlpatterns = [
    path("board/", board_views.board, name="board"),
    path("board/launch/", board_views.board_launch, name="board-launch"),
    path("board/<str:launch_id>/teardown/", board_views.board_teardown, name="board-teardown"),
]
